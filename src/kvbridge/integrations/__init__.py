"""kvbridge inside serving engines. `vllm`: a vLLM KV connector, a P/D demo and a benchmark."""
