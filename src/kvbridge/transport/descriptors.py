"""Descriptor and socket budgets sized to the process (issue 44.2).

Why: a rank holds ZMQ sockets per peer (a side-channel DEALER and its monitor pair per source
rank, a notification PUSH per peer agent), and ZMQ refuses the 1,024th socket of a context by
default (`MAX_SOCKETS` 1,023): a prefill rank 0 then turned away the 128th TP-8 decode engine and a
decode rank held at most 341 source ranks, whatever the host could carry. And a soft descriptor
limit of 1,024, common in containers, stopped it sooner, though the hard limit is usually far
above. So a process that makes ZMQ contexts raises its soft limit toward the hard one once (as
vLLM's API server does, at most `MAX_RAISE`), and each context it makes may hold a quarter of that
limit in sockets (`socket_budget`), within what libzmq can poll (`SOCKET_LIMIT`) and never below
ZMQ's default.
"""

from __future__ import annotations

import threading

import zmq

ZMQ_DEFAULT_SOCKETS = 1023
MAX_RAISE = 1 << 17
"""The soft descriptor limit is raised at most to this (vLLM's API server raises its to 65,535)."""
_raised: int | None = None
_lock = threading.Lock()


def _nr_open() -> int:
    """The kernel's bound on any process's descriptors (`fs.nr_open`), where Linux says it."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20


def raise_descriptor_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE toward its hard limit, at most to `MAX_RAISE`, once;
    returns the soft limit now (unchanged where the platform or the hard limit does not allow more)."""
    global _raised
    with _lock:
        if _raised is not None:
            return _raised
        try:
            import resource
        except ImportError:  # not a POSIX platform: nothing to raise
            _raised = ZMQ_DEFAULT_SOCKETS + 1
            return _raised
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # Up to what the sockets can use, not to a hard limit of 2^20 or more: every child
        # inherits the limit, and code that loops over or selects on descriptors slows or breaks.
        target = min(MAX_RAISE, _nr_open() if hard == resource.RLIM_INFINITY else hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
        _raised = _nr_open() if soft == resource.RLIM_INFINITY else soft
        return _raised


def socket_budget(limit: int | None = None) -> int:
    """Sockets one context may hold under a descriptor limit of `limit` (this process's, raised): a
    quarter of it, since a process holds two or more contexts (its side channel's and each agent's
    notification channel) and every socket takes a descriptor or two, and the rest of the process
    (vLLM, Mooncake, files) needs its own."""
    limit = raise_descriptor_limit() if limit is None else limit
    return max(ZMQ_DEFAULT_SOCKETS, min(_socket_limit(), limit // 4))


_zmq_limit: int | None = None


def _socket_limit() -> int:
    """The most sockets libzmq can poll in one context (65,535 with epoll)."""
    global _zmq_limit
    if _zmq_limit is None:
        probe = zmq.Context()
        try:
            _zmq_limit = int(probe.get(zmq.SOCKET_LIMIT))
        finally:
            probe.term()
    return _zmq_limit


def sized(ctx: zmq.Context) -> zmq.Context:
    """`ctx` allowed `socket_budget()` sockets. libzmq reads `MAX_SOCKETS` when the context makes
    its first socket, so this is called before that (a context already started keeps its own)."""
    budget = socket_budget()
    if ctx.get(zmq.MAX_SOCKETS) < budget:
        ctx.set(zmq.MAX_SOCKETS, budget)
    return ctx


__all__ = ["MAX_RAISE", "ZMQ_DEFAULT_SOCKETS", "raise_descriptor_limit", "socket_budget", "sized"]
