"""Pool objects sealed in confidence: every payload encrypted and authenticated (AES-256-GCM).

Why encrypt, not only authenticate: anyone who reaches the store (a plain Mooncake client with
the master's address) can list names and `get` objects, and KV in clear discloses the prompt
that made it (KV inversion). So an object's bytes in the store are its payload encrypted,
followed by a 64-byte seal: the GCM tag (16), where its key and nonce come from (32: the writer's
id, 16, and its seal count, 8, then 8 zero bytes), magic `KVB5`, the payload length (8) and 4
reserved zero bytes.

Keys. The fleet's secret and a request's tenant (vLLM's `cache_salt`, empty for none) give the
tenant key (keyed BLAKE3: one tenant's key opens no other tenant's objects). Each process that
writes is a *writer* with an id of its own (128 random bits, drawn at start, again in a forked
child and after 2^32 seals); its objects of one tenant are encrypted under the writer key, a keyed
BLAKE3 of that id under the tenant key, with the writer's count of its seals as the nonce.

Why nonces are derived, never drawn: an object name is written again and again (by engines of
other shapes, whose bytes differ in the last bits; again after an eviction), and a GCM key and
nonce used twice on different bytes leak both plaintexts and the key's authenticator. A writer's
count never goes back, so no nonce repeats under its key; two writers share a key only if they
drew the same id (2^-128 per pair). A writer key encrypts at most 2^32 objects (NIST SP 800-38D's
bound, kept although a counter nonce does not need it). The reader finds the writer's id and count
in the seal and derives the same key (cached per writer). No per-object key is derived: a key
derivation and a cipher set-up per object were a third of a 32 KiB object's seal (format 4).

The name and length are the GCM tag's associated data: an object moved to another name, cut,
or written by anyone without the tenant key fails its check, compared in constant time by
OpenSSL. Without a secret (`insecure`) the keys derive from an empty secret: everyone can
compute them, so objects are only checked against damage (as a checksum would). The same secret
under another personalisation names the objects (`mac_key`, `objects.block_name`), so names say
nothing without it.

Cost: a store encrypts each payload once (AES-GCM with VAES, straight into where it is stored), a
load decrypts it once (straight into staging). `cryptography` 50 releases the GIL in its AEAD
calls (48 did not: measured, two threads no faster than one), so a call's objects are sealed and
opened on `SEAL_THREADS` threads (`seal_all`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import blake3
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"KVB5"
TAG_BYTES = 16
SEAL_BYTES = 64
"""Bytes an object has beyond its payload: tag, derivation value, magic, length, reserved."""
_CONTEXT = "kvbridge 2026-11 pool object key v5"
_TAIL = struct.Struct("<16s32s4sQ4x")  # tag, derivation value, magic, payload length
_DERIVATION = struct.Struct("<16sQ8x")  # writer id, seal count
_ROTATE = 1 << 32
"""Seals under one writer key before the writer draws a new id."""
assert _TAIL.size == SEAL_BYTES


@lru_cache(maxsize=8)
def mac_key(secret: bytes) -> bytes:
    """BLAKE2b's key (at most 64 bytes) for a secret of any length: longer ones are digested, not cut."""
    return secret if len(secret) <= 64 else hashlib.blake2b(secret, person=b"kvbridge-key").digest()


@lru_cache(maxsize=1024)
def tenant_key(secret: bytes, tenant: bytes = b"") -> bytes:
    """The 32-byte key of one tenant's objects (`tenant`: vLLM's cache_salt, b"" for none)."""
    root = blake3.blake3(secret, derive_key_context=_CONTEXT).digest()
    return blake3.blake3(b"tenant\0" + tenant, key=root).digest()


class _Writer:
    """This process's writer id and seal count (see the module): one tuple, so a seal reads an id
    and the count of that id together while another thread draws the next id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.renew()

    def renew(self) -> None:
        self.state = (os.urandom(16), itertools.count())

    def next(self) -> tuple[bytes, int]:
        while True:
            ident, counter = self.state
            count = next(counter)  # next() of a count is atomic under the GIL
            if count < _ROTATE:
                return ident, count
            with self._lock:
                if self.state[0] is ident:
                    self.renew()


_writer = _Writer()
os.register_at_fork(after_in_child=_writer.renew)


@lru_cache(maxsize=4096)
def _writer_key(tkey: bytes, writer: bytes) -> AESGCM:
    """The key of one writer's objects of one tenant (a reader meets few writers: cached)."""
    return AESGCM(blake3.blake3(b"writer\0" + writer, key=tkey).digest())


def _nonce(count: int) -> bytes:
    return count.to_bytes(12, "little")


def _aad(name: bytes, length: int) -> bytes:
    return name + length.to_bytes(8, "little")


def seal_into(tkey: bytes, name: str, pieces: Sequence[np.ndarray], out: np.ndarray) -> None:
    """Encrypt the payload `pieces` of object `name` into `out` (payload bytes + `SEAL_BYTES`)."""
    length = sum(int(p.nbytes) for p in pieces)
    if out.nbytes != length + SEAL_BYTES:
        raise ValueError(f"an object of {length} payload bytes seals into {length + SEAL_BYTES}, got {out.nbytes}")
    key = name.encode()
    writer, count = _writer.next()
    if len(pieces) == 1:
        data = pieces[0]
    else:  # gathered into the output, then encrypted where it lies
        at = 0
        for p in pieces:
            out[at:at + p.nbytes] = p
            at += p.nbytes
        data = out[:length]
    _writer_key(tkey, writer).encrypt_into(_nonce(count), data, _aad(key, length), out[:length + TAG_BYTES])
    tail = out[length:]
    tail[TAG_BYTES:] = np.frombuffer(_TAIL.pack(b"", _DERIVATION.pack(writer, count), MAGIC, length)[TAG_BYTES:],
                                     dtype=np.uint8)


_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A buffer of this thread's to decrypt a multi-piece object into (not one allocation per object)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.buf = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
    return buf[:nbytes]


def open_into(tkey: bytes, name: str, sealed: np.ndarray, pieces: Sequence[np.ndarray]) -> str:
    """Check and decrypt object `name`'s stored bytes `sealed` into `pieces`: '' when it is what
    its name promises, else why not (one line). On a refusal `pieces` hold garbage."""
    length = sum(int(p.nbytes) for p in pieces)
    if sealed.nbytes != length + SEAL_BYTES:
        return f"object of {sealed.nbytes} bytes, expected {length + SEAL_BYTES}"
    _, derivation, magic, sealed_length = _TAIL.unpack(bytes(sealed[length:]))
    if magic != MAGIC:
        return "no kvbridge seal (magic differs)"
    if sealed_length != length:
        return f"sealed payload of {sealed_length} bytes, expected {length}"
    key = name.encode()
    writer, count = _DERIVATION.unpack(derivation)
    aead, nonce = _writer_key(tkey, writer), _nonce(count)
    try:
        if len(pieces) == 1:
            aead.decrypt_into(nonce, sealed[:length + TAG_BYTES], _aad(key, length), pieces[0])
        else:
            plain = _scratch(length)
            aead.decrypt_into(nonce, sealed[:length + TAG_BYTES], _aad(key, length), plain)
            at = 0
            for p in pieces:
                p[:] = plain[at:at + p.nbytes]
                at += p.nbytes
    except InvalidTag:
        return "authentication failed (corrupt, forged, another tenant's or stored under another name)"
    return ""


SEAL_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that seal or open one call's objects side by side (AES-GCM releases the GIL)."""
_MIN_SPLIT_BYTES = 1 << 20
"""Below this many payload bytes a call stays on the caller's thread: a hand-off costs more."""
_MIN_THREAD_OBJECT = 128 << 10
"""Objects smaller than this on average are sealed on one thread: each AES-GCM call of a 32 KiB
object is shorter than the GIL hand-offs around it, and two threads took 1.5x one's time
(measured 2026-11-29 on this 2-core host: 512 KiB objects gain 1.5x from a second thread)."""
_pool: ThreadPoolExecutor | None = None


def seal_all(work: Sequence[Callable[[], str | None]], nbytes: int) -> list[str | None]:
    """Run each sealing or opening step of one call, on `SEAL_THREADS` threads when the call
    moves enough bytes to gain by it; results in order. Threads are started once per process
    and inherit the priority of the thread that first needs them (a store thread's nice)."""
    global _pool
    if SEAL_THREADS == 1 or nbytes < _MIN_SPLIT_BYTES or len(work) < 2 or nbytes < _MIN_THREAD_OBJECT * len(work):
        return [w() for w in work]
    if _pool is None:
        _pool = ThreadPoolExecutor(SEAL_THREADS, thread_name_prefix="kvbridge-seal")
    k = min(SEAL_THREADS, len(work))
    parts = [work[i * len(work) // k:(i + 1) * len(work) // k] for i in range(k)]
    futures = [_pool.submit(lambda part=part: [w() for w in part]) for part in parts[1:]]
    out = [w() for w in parts[0]]  # the caller's thread takes a share too
    for f in futures:
        out += f.result()
    return out


__all__ = ["MAGIC", "SEAL_BYTES", "SEAL_THREADS", "mac_key", "open_into", "seal_all", "seal_into", "tenant_key"]
