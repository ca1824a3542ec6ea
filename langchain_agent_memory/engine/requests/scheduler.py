"""Which request the engine's worker thread advances next.

Every request is a small state machine (``Phase``): admitted (its cache found and loaded),
then prefilling its new tokens chunk by chunk, then decoding one token per step, then done
(committed). Each scheduler step runs one batched decode step for *all* decoding requests
(one forward pass: the weights are read once for the whole batch) and one prefill chunk of
one prefilling request. Requests join and leave the decode batch between steps.

Policies:

- ``"interleave"`` (default): the prefilling request with the fewest tokens left goes
  first (shortest remaining prefill), so an agent whose cache is warm or hot (a short
  prefill) never waits behind another agent's long cold prefill for more than one chunk
  (the engine's chunks are small on the CPU: ``device.CPU_CHUNK_TOKENS``; a prefill with
  no other request to serve takes ``alone_chunk_tokens``), and decoding agents get a token
  between any two chunks. What a step's chunk leaves goes to other requests whose whole
  prefill fits in it (the short tails of a fan-out finish together).
- ``"fcfs"``: one request at a time, in arrival order, to its end: what an engine without
  a scheduler does (kept to measure the difference).

Two requests for the same agent never run at once: the later one waits for the earlier
one's commit (it then extends that cache).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol

#: ``remaining_prefill`` of a request waiting for another's prefix (``steps``): it is
#: scheduled last, and the request it waits for prefills as if alone.
WAITING = 1 << 40
#: Decode steps kept per batch size for the median step time (``Engine.stats``).
RECENT_STEPS = 64


class Phase(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Schedulable(Protocol):
    agent_id: str
    phase: Phase
    arrival: int

    @property
    def remaining_prefill(self) -> int: ...


POLICIES = ("interleave", "fcfs")


class Scheduler:
    def __init__(
        self,
        admit: Callable[[Schedulable], None],
        prefill: Callable[[Schedulable, int], None],
        decode: Callable[[list[Schedulable]], None],
        policy: str = "interleave",
        chunk_tokens: int = 512,
        alone_chunk_tokens: int | None = None,
        prefill_whole: Callable[[list[Schedulable]], None] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, not {policy!r}")
        self._admit, self._prefill, self._decode = admit, prefill, decode
        #: Several requests' whole remaining prefills in one batched forward pass (none:
        #: one ``prefill`` call each)
        self._prefill_whole = prefill_whole
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        #: The chunk of a prefill with nothing else to serve: larger chunks run the model's
        #: matmuls nearer their peak, and no other request waits behind them (a request
        #: arriving meanwhile waits for one of them at most; the next step is small again).
        self.alone_chunk_tokens = alone_chunk_tokens or chunk_tokens
        self.waiting: deque[Schedulable] = deque()
        self.active: list[Schedulable] = []
        self.steps = 0
        self.max_batch = 0  # the largest decode batch seen (for stats and tests)
        #: batch size -> (decode steps, seconds in them): steady-state throughput per size
        self.decode_time: dict[int, tuple[int, float]] = {}
        #: batch size -> the latest steps' seconds: a median free of the rare steps in which
        #: members joined or left (a copy of the batch each) or a turn was committed
        self.decode_recent: dict[int, deque[float]] = {}

    def submit(self, request: Schedulable) -> None:
        self.waiting.append(request)

    def in_flight(self) -> list[Schedulable]:
        """The requests queued or running (a copy: another thread may read it)."""
        return [*list(self.waiting), *list(self.active)]

    def stats(self) -> dict[str, Any]:
        decode_time = sorted(self.decode_time.items())
        return {
            "scheduling": self.policy,
            "max_decode_batch": self.max_batch,
            # batch size -> generated tokens per second while that many agents decoded together
            "decode_tokens_per_s": {b: b * n / total for b, (n, total) in decode_time if total},
            # batch size -> the median of its latest steps (seconds): joins and leaves left out
            "decode_step_median_s": {b: statistics.median(t) for b, t in sorted(self.decode_recent.items())},
            # batch size -> [decode steps, seconds in them] (to difference over an interval)
            "decode_steps": {b: [n, total] for b, (n, total) in decode_time},
        }

    def has_work(self) -> bool:
        return bool(self.active or self.waiting)

    def step(self) -> None:
        """Admit what can start, then one batched decode step and one prefill chunk."""
        self._admit_waiting()
        decoding = [r for r in self.active if r.phase is Phase.DECODE]
        prefilling = [r for r in self.active if r.phase is Phase.PREFILL]
        if decoding:
            self.max_batch = max(self.max_batch, len(decoding))
            t0 = time.perf_counter()
            self._decode(decoding)
            took = time.perf_counter() - t0
            n, total = self.decode_time.get(len(decoding), (0, 0.0))
            self.decode_time[len(decoding)] = (n + 1, total + took)
            self.decode_recent.setdefault(len(decoding), deque(maxlen=RECENT_STEPS)).append(took)
        if prefilling:
            if self.policy == "interleave":
                request = min(prefilling, key=lambda r: (r.remaining_prefill, r.arrival))
            else:
                request = prefilling[0]
            # Alone: nothing else to serve (requests waiting for this one's prefix need it
            # done first: a fan-out's source prefills in the larger chunks)
            alone = not self.waiting and all(
                r is request or (r.phase is Phase.PREFILL and r.remaining_prefill >= WAITING)
                for r in self.active
            )
            chunk = self.alone_chunk_tokens if alone else self.chunk_tokens
            budget = chunk - min(request.remaining_prefill, chunk)
            if self.policy == "interleave" and request.remaining_prefill <= chunk:
                self._prefill_together([request, *self._short(prefilling, request, budget)])
            else:
                self._prefill(request, chunk)
                if self.policy == "interleave":
                    self._prefill_together(self._short(prefilling, request, budget))
        self.active = [r for r in self.active if r.phase is not Phase.DONE]
        self.steps += 1

    def _short(self, prefilling: list[Schedulable], done: Schedulable, budget: int) -> list[Schedulable]:
        """Other requests whose whole prefill fits in what is left of the step's chunk
        (fewest tokens first): a fan-out's short tails then finish in one step and join the
        decode batch together (one merged-buffer build, not one per member)."""
        chosen: list[Schedulable] = []
        for request in sorted(
            (r for r in prefilling if r is not done), key=lambda r: (r.remaining_prefill, r.arrival)
        ):
            need = request.remaining_prefill
            if need > budget:
                break
            chosen.append(request)
            budget -= need
        return chosen

    def _prefill_together(self, requests: list[Schedulable]) -> None:
        """The whole remaining prefill of each of ``requests``: one batched forward pass
        where the steps offer it, else one call each."""
        if len(requests) > 1 and self._prefill_whole is not None:
            self._prefill_whole(requests)
            return
        for request in requests:
            if request.phase is Phase.PREFILL:
                self._prefill(request, request.remaining_prefill)

    def _admit_waiting(self) -> None:
        busy = {r.agent_id for r in self.active}
        for request in list(self.waiting):
            if self.policy == "fcfs" and self.active:
                return
            if request.agent_id in busy:
                continue  # after the running request for this agent commits
            self.waiting.remove(request)
            self._admit(request)
            if request.phase is not Phase.DONE:
                self.active.append(request)
                busy.add(request.agent_id)
