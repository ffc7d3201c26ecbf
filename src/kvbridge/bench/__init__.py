"""Benchmarks beside the library: local executor, transports, offload.
"""
