"""kvbridge inside vLLM (placeholder; filled below)."""
