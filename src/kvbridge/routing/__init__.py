"""KV-cache-aware routing for fleets of any block sizes (issue 45).

vLLM publishes what each instance's prefix cache holds as KV events, in that instance's block
size; a router that scores instances by them (vllm-router's `kv_aware`, llm-d's indexer) takes
one block size. `rechunk` turns one instance's events into a canonical block size by token ids,
`relay` does it for every instance of a fleet over ZMQ, and `events` is the wire both speak.
"""
