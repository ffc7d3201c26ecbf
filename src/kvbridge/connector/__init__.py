"""The request lifecycle between a prefill engine and a decode engine of any shapes.

One concept per module:

* `messages`: the side-channel protocol (versioned, size-bounded msgspec structs, fingerprint);
* `side_channel`: ZMQ ROUTER (prefill) / DEALER (decode) sockets, every receive bounded;
* `handshake`: the rules both sides apply to a peer's Hello before any byte moves;
* `config`: every deadline in one place;
* `runs`: planner output -> transport runs, from the posting agent's side;
* `producer` / `consumer`: the prefill and decode state machines an engine drives;
* `transports`: constructing a backend by name, allocating memory it can register;
* `processes`, `decode_job`, `demo`: one OS process per rank, and the transformers proof.

An engine drives one `Producer` per prefill rank and one `Consumer` per decode rank:

    producer = Producer("prefill", rank, cache, transport, listen="10.0.0.5:5600", mode="pull",
                        on_release=free_blocks)
    consumer = Consumer("decode", rank, cache, transport, mode="pull")
    consumer.connect("10.0.0.5:5600")
    producer.add_request("req-1", src_block_ids, num_tokens, first_token)   # prefill finished
    consumer.receive("req-1", dst_block_ids, num_tokens=num_tokens)       # blocks allocated
    ... each engine step: producer.progress(); results = consumer.progress()
"""

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.consumer import Consumer, RequestResult
from kvbridge.connector.messages import (PROTOCOL_VERSION, FrameTooLarge, HandshakeRefused, ProtocolError,
                                        VersionMismatch)
from kvbridge.connector.producer import Producer

__all__ = ["ConnectorConfig", "Consumer", "FrameTooLarge", "HandshakeRefused", "PROTOCOL_VERSION", "Producer",
           "ProtocolError", "RequestResult", "VersionMismatch"]
