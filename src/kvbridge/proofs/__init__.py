"""Proofs beside the library: the transformers bridge, tiny models, the demos and the byte-pattern verifier.

The library (core, engines, integrations) never imports this package.
"""
