"""The core: model geometry, shards, block rules, layouts, the planner, topology and integrity.

Pure numpy and msgspec: nothing here imports torch, numba, transformers or anything outside the core.
"""
