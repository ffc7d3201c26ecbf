"""Every waiting request's pool lookup of one scheduler step in one call, and one short wait per step.

Why: vLLM asks a connector about each waiting request in turn, inside one `schedule()`. A lookup
per request sent on its own, each waited for inline, let N new requests stall one step by N
times the inline wait when the store is slow (a hung master: N x 20 ms, every step). Here:

* a request's keys are sent at once when no lookup call is in flight (a healthy store answers
  within the inline wait, so the request is scheduled this step); otherwise they wait, with every
  other request asked meanwhile, for the next call: one call, keys deduplicated, sent when the
  call in flight ends or the step ends (`step_ended`), whichever comes first;
* the inline wait is a budget of the *step*, not of the request: the first wait of a step may
  take up to `inline_wait_s`, later ones only what is left of it.

Lookups that ask the host tier alone (the store away: `remote=False`) go to a thread of their own
when one is given (`host_thread`): a call to a hung master holds its thread for as long as the
master is stopped, and the host tier's answers must not wait behind it.

A request not answered within its caller's timeout is the caller's to give up (`forget`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvbridge.pool.background import Call, PoolThread

HitsFn = Callable[[Call, list[Any], bool], tuple[list[bool], bool]]
"""`(call, keys, remote) -> (per key present, whether the store answered for every key)`."""


class Answer(NamedTuple):
    keys: list[Any]
    present: list[bool]
    answered: bool
    remote: bool
    error: BaseException | None = None


class _Asked(NamedTuple):
    keys: list[Any]
    remote: bool
    since: float


class BatchedLookups:
    """Lookups of waiting requests batched per step (see the module). Used from one thread (vLLM's
    scheduler); the calls run on `thread`."""

    def __init__(self, thread: PoolThread, hits: HitsFn, inline_wait_s: float, host_thread: PoolThread | None = None):
        self._threads = {True: thread, False: host_thread or thread}
        self._hits, self.inline_wait_s = hits, inline_wait_s
        self._asked: dict[str, _Asked] = {}
        self._unsent: list[str] = []
        self._sent: dict[str, tuple[Call, list[int]]] = {}  # request -> its call, its keys' places in the call
        self._in_flight: dict[bool, Call] = {}  # per remote flag: the call sent last
        self._deadline: float | None = None  # when this step's inline wait ends (set by its first wait)
        self.step_waits: list[float] = []
        """Inline waits granted this step (seconds each): their sum never passes `inline_wait_s`."""
        self.calls = 0

    def asked(self, rid: str) -> bool:
        return rid in self._asked

    def age(self, rid: str) -> float:
        return time.monotonic() - self._asked[rid].since

    def remote(self, rid: str) -> bool:
        return self._asked[rid].remote

    def ask(self, rid: str, keys: Sequence[Any], remote: bool) -> bool:
        """Queue request `rid`'s lookup of `keys`; sent at once when no call is in flight. False
        when the pool thread refused it (its queue full, or closed): a miss."""
        self._asked[rid] = _Asked(list(keys), remote, time.monotonic())
        self._unsent.append(rid)
        self._send()
        return rid in self._asked

    def wait(self, rid: str) -> None:
        """Wait for `rid`'s answer, at most what is left of this step's inline wait."""
        sent = self._sent.get(rid)
        if sent is None or sent[0].done.is_set():
            return
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.inline_wait_s
        granted = max(0.0, self._deadline - now)
        self.step_waits.append(granted)
        if granted:
            sent[0].wait(granted)

    def answer(self, rid: str) -> Answer | None:
        """`rid`'s answer once its call is done (with its error if the call raised), else None. An
        answer is given once: the request is forgotten with it."""
        sent = self._sent.get(rid)
        if sent is None:
            self._send()
            sent = self._sent.get(rid)
        if sent is None or not sent[0].done.is_set():
            return None
        call, places = sent
        asked = self._asked[rid]
        self.forget(rid)
        if call.error is not None or call.result is None:  # raised, or dropped unrun by a closing thread
            error = call.error or RuntimeError("the lookup call was dropped unrun (its pool thread closed)")
            return Answer(asked.keys, [], False, asked.remote, error)
        present, answered = call.result
        return Answer(asked.keys, [present[i] for i in places], answered, asked.remote)

    def step_ended(self) -> None:
        """The scheduler's step is over: send what waits (when nothing is in flight) and give the
        next step its inline wait."""
        self._deadline = None
        self.step_waits = []
        self._send()

    def forget(self, rid: str) -> None:
        self._asked.pop(rid, None)
        self._sent.pop(rid, None)
        if rid in self._unsent:
            self._unsent.remove(rid)

    def _busy(self, remote: bool) -> bool:
        """Whether the thread that `remote` lookups go to has a lookup call in flight."""
        thread = self._threads[remote]
        return any(not c.done.is_set() for flag, c in self._in_flight.items() if self._threads[flag] is thread)

    def _send(self) -> None:
        """One call per remote flag for its unsent requests, when its thread has no lookup call in
        flight (a request the thread refuses is forgotten: a miss)."""
        for remote in (True, False):
            rids = [r for r in self._unsent if r in self._asked and self._asked[r].remote is remote]
            if not rids or self._busy(remote):
                continue
            keys: list[Any] = []
            place: dict[Any, int] = {}
            places = []
            for r in rids:
                mine = []
                for k in self._asked[r].keys:
                    if k not in place:
                        place[k] = len(keys)
                        keys.append(k)
                    mine.append(place[k])
                places.append(mine)
            call = self._threads[remote].submit(self._hits, keys, remote)
            sent = set(rids)
            self._unsent = [r for r in self._unsent if r not in sent]
            if call is None:
                for r in rids:
                    self._asked.pop(r, None)
                continue
            self.calls += 1
            self._in_flight[remote] = call
            for r, mine in zip(rids, places):
                self._sent[r] = (call, mine)


__all__ = ["Answer", "BatchedLookups", "HitsFn"]
