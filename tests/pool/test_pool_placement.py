"""Where a rank's puts land, and that the in-memory copy Mooncake then uses moves the right bytes.

`prefer_own_segment` asks the master for the writer's own segment, so that `local_memcpy` can turn
the put into a memcpy; it must stay a preference (a full segment spills to others, never fails a
put), and objects in one process's segment must still read back exactly from another process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from kvbridge.pool.store import StoreClient, StoreConfig

OBJ = 32 << 10


def _endpoints(client: StoreClient, keys: list[str]) -> list[str]:
    return [client._store.get_replica_desc(k)[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
            for k in keys]


def _put(client: StoreClient, src: torch.Tensor, keys: list[str]) -> list[int]:
    return client.put(keys, [[(src.data_ptr() + i * OBJ, OBJ)] for i in range(len(keys))])


def test_a_rank_puts_into_its_own_segment_while_it_has_room_then_anywhere(master):
    others = [StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=64 << 20)) for _ in range(2)]
    own = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=16 << 20))
    spread = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=16 << 20,
                                     prefer_own_segment=False))
    try:
        src = torch.randint(0, 256, (1024 * OBJ,), dtype=torch.uint8)
        for c in (own, spread):
            c.register(src.data_ptr(), src.numel())
        first = [f"placement/own/{i}" for i in range(256)]  # 8 MiB: fits the own 16 MiB segment
        assert set(_put(own, src, first)) == {0}
        (here,) = set(_endpoints(own, first))  # one segment of four: spread at random, 256 puts never are
        more = [f"placement/more/{i}" for i in range(512)]  # 16 MiB more: half fits, the rest spills
        assert set(_put(own, src, more)) == {0}
        placed = _endpoints(own, more)
        assert 0 < placed.count(here) <= 256 and len(set(placed)) > 1
        dst = torch.zeros(768 * OBJ, dtype=torch.uint8)
        own.register(dst.data_ptr(), dst.numel())
        assert own.get(first + more, [[(dst.data_ptr() + i * OBJ, OBJ)] for i in range(768)]) == [OBJ] * 768
        assert torch.equal(dst[:256 * OBJ], src[:256 * OBJ]) and torch.equal(dst[256 * OBJ:], src[:512 * OBJ])
        # Without the preference the master spreads a writer's puts over every segment with room.
        third = [f"placement/spread/{i}" for i in range(128)]
        assert set(_put(spread, src, third)) == {0}
        assert len(set(_endpoints(spread, third))) > 1
    finally:
        for c in (own, spread, *others):
            c.close()


READER = textwrap.dedent("""
    import hashlib, sys, torch
    from kvbridge.pool.store import StoreClient, StoreConfig
    n, size = int(sys.argv[3]), int(sys.argv[4])
    c = StoreClient(StoreConfig(sys.argv[1], sys.argv[2], segment_bytes=16 << 20))
    dst = torch.zeros(n * size, dtype=torch.uint8)
    c.register(dst.data_ptr(), dst.numel())
    codes = c.get([f"placement/x/{i}" for i in range(n)], [[(dst.data_ptr() + i * size, size)] for i in range(n)])
    print(sorted(set(codes)), hashlib.sha256(dst.numpy().tobytes()).hexdigest())
    c.close()
""")


def test_objects_put_by_memcpy_read_back_exactly_from_another_process(master):
    """Mooncake's in-memory path once took another process's segment for its own (and copied from
    a pointer of that process); a reader in another process must get the writer's bytes."""
    import hashlib

    writer = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=16 << 20))
    try:
        n = 128
        src = torch.randint(0, 256, (n * OBJ,), dtype=torch.uint8)
        writer.register(src.data_ptr(), src.numel())
        keys = [f"placement/x/{i}" for i in range(n)]
        assert set(_put(writer, src, keys)) == {0}
        assert len(set(_endpoints(writer, keys))) == 1
        out = subprocess.run([sys.executable, "-c", READER, master.address, master.metadata_url, str(n), str(OBJ)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == hashlib.sha256(src.numpy().tobytes()).hexdigest()
        assert out.stdout.startswith(f"[{OBJ}]")
    finally:
        writer.close()
