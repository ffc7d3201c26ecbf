"""The request lifecycle between a prefill engine and a decode engine (placeholder; filled below)."""
