"""The vLLM proof: tiny model directories, vLLM instances in their own processes, the P/D demo and bench.
"""
