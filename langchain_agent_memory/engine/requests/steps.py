"""A request's steps as the scheduler runs them on the worker thread: admit (its cache
found and loaded), prefill chunks, decode steps (batched with the other decoding
requests), finish (commit). A step that fails fails its request only; the others go on."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..caches.agent_state import Admission
from ..caches.agents import AgentCaches
from ..caches.prefix_index import Prompt
from ..caches.states import thin_held
from ..kv import RecurrentCache
from ..ops.runtime import mx
from ..prefix import MatchKind, PrefixMatch, TokenizedText
from ..results import (
    CacheOutcome,
    CacheSource,
    ContextLengthError,
    GenerationParams,
    GenerationResult,
    StreamChunk,
    Timings,
)
from ..storage.blocks import BLOCK_TOKENS
from ..storage.protocols import Lease
from .committer import Committer
from .forks import can_fork, clean_cut, fork_layers, worth_forking
from .runner import ModelRunner, Penalties, Sampler
from .scheduler import WAITING, Phase
from .text import TextStream, last_clean, token_ends
from .worker import Sink


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler advances it (``scheduler.Schedulable``)."""

    agent_id: str
    #: tokenized once, where the request came in (``Engine``)
    prompt: Prompt
    params: GenerationParams
    cancel: threading.Event
    sink: Sink
    arrival: int
    phase: Phase = Phase.PREFILL
    t_start: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=Timings)
    start: Admission | None = None  # where its cache began (set when admitted)
    prefilled: int = 0  # tokens of ``start.tail`` run so far
    max_new: int = 0  # tokens it may generate: max_tokens, or what the context has left
    sampler: Sampler | None = None
    stream: TextStream | None = None
    generated: list[int] = field(default_factory=list)
    token: int = 0  # sampled, to be fed next (already fed while ``ahead`` is set)
    #: The draw after ``token``, in flight (``RequestSteps._decode_ahead``): ``token`` went
    #: through the model before it was accepted, so the caches hold one token more.
    ahead: mx.array | None = None
    ended_by_eos: bool = False
    decode_t0: float = 0.0
    #: (request, tokens): start from a copy of that in-flight request's first ``tokens``
    #: once it holds them (``forks``), instead of prefilling them again.
    share: tuple[Request, int] | None = None
    #: The agent's lease in a shared store, taken before the request reached the model's
    #: thread (``admissions``); None: ``admit`` takes it (a local store's holds nothing).
    lease: Lease | None = None

    @property
    def holds(self) -> int:
        """Prompt tokens its layer caches hold so far."""
        return len(self.start.known) + self.prefilled if self.start is not None else 0

    @property
    def remaining_prefill(self) -> int:
        """Tokens left to prefill (for the scheduler's order): while it waits for a shared
        prefix, last of all (its source runs first); once that is ready, what is left after
        the fork."""
        if self.start is None:
            return 0
        left = len(self.start.tail) - self.prefilled
        if self.share is None:
            return left
        source, tokens = self.share
        if source.phase is Phase.PREFILL and source.holds < tokens:
            return WAITING
        return left - (tokens - len(self.start.known))


class RequestSteps:
    """What the scheduler calls for each request (see ``scheduler``)."""

    def __init__(
        self,
        agents: AgentCaches,
        runner: ModelRunner,
        tokenizer: Any,
        context_length: int,
        model_name: str,
        committer: Committer,
        share_prefixes: bool = True,
    ) -> None:
        self.agents, self.runner, self.tokenizer = agents, runner, tokenizer
        self.context_length, self.model_name = context_length, model_name
        #: the loop's way down to the store for a finished turn's save
        self.committer = committer
        self.eos = set(tokenizer.eos_token_ids)
        #: Fork prefixes in-flight requests share (``forks``); off: each prefills its own.
        self.share_prefixes = share_prefixes
        #: admitted, not finished: candidate sources (the prefix index knows their prompts)
        self.inflight: list[Request] = []
        #: Requests admitted, by where their cache came from (hot / warm / cold).
        self.turns: Counter[str] = Counter()
        #: Decode runs one step ahead (``_decode_ahead``); off, each step reads its tokens
        #: before the next step is built (benchmarks/decode_ahead.py).
        self.decode_ahead = True
        #: Requests finished in the decode step under way (``_finishing_together``).
        self._finishing: list[tuple[Request, str]] | None = None

    def admit(self, req: Request) -> None:
        """Find and load the agent's cache, tokenize what it lacks: ready to prefill."""
        try:
            start = self.agents.admit(req.agent_id, req.prompt, req.lease)
            req.start, req.timings.load_s = start, start.load_s
            self.turns[start.source.value] += 1
            prompt_tokens = start.reused + len(start.tail)
            p = req.params
            limit = min(self.context_length, p.context_length or self.context_length)
            if prompt_tokens >= limit:
                raise ContextLengthError(
                    f"the prompt is {prompt_tokens} tokens; {self.model_name} reads at most "
                    f"{limit} here (prompt and reply): shorten the messages or start a new agent"
                )
            req.max_new = min(p.max_tokens, limit - prompt_tokens)
            penalties = Penalties.of(
                p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.penalty_window
            )
            context = (start.known.ids + start.tail.ids)[-p.penalty_window :] if penalties else []
            req.sampler = Sampler(
                p.temperature, p.top_p, p.seed, p.constraint, p.top_k, p.min_p, penalties, context
            )
            last = (start.tail.ids or start.known.ids)[-1:] or [None]
            req.stream = TextStream(self.tokenizer, p.stop, anchor=last[0] if p.exact_text else None)
            self.inflight.append(req)
            if self.share_prefixes:
                req.share = self._shared_prefix(req)
                self.agents.index.fly(req, start.known.ids + start.tail.ids)
        except BaseException as exc:
            self.fail(req, exc)

    def _shared_prefix(self, req: Request) -> tuple[Request, int] | None:
        """The in-flight request whose prompt shares the longest prefix with ``req``'s (the
        prefix index's answer), and how many tokens to fork, if that is worth it
        (``worth_forking``)."""
        start = req.start
        assert start is not None
        ids = start.known.ids + start.tail.ids
        found = self.agents.index.inflight_source(ids)
        if found is None:
            return None
        best, best_n = found
        assert isinstance(best, Request)
        full = _joined(start.known, start.tail)
        step = BLOCK_TOKENS if any(isinstance(c, RecurrentCache) for c in start.layers) else 1
        n = clean_cut(full, min(best_n, len(ids) - 1), step)  # one token at least is run: its logits
        return (best, n) if worth_forking(n - start.reused, n - best.holds) else None

    def _fork(self, req: Request) -> None:
        """Start ``req``, and every other request waiting on the same source, from copies of
        the source's caches: all at once, before any of them joins the decode batch (a
        source merged into the batch cannot be forked; see ``_fork_one``)."""
        assert req.share is not None
        source = req.share[0]
        for other in [r for r in self.inflight if r.share is not None and r.share[0] is source]:
            if other is req or other.remaining_prefill != WAITING:
                self._fork_one(other)
        if req.share is not None:
            self._fork_one(req)

    def _fork_one(self, req: Request) -> None:
        """Start ``req`` from a copy of its source's caches, if they can still be forked
        (not merged into a decode batch, holding the window each layer needs); otherwise it
        prefills those tokens itself."""
        assert req.share is not None and req.start is not None
        source, tokens = req.share
        req.share = None
        src = source.start
        if (
            source.phase is Phase.DONE
            or src is None
            or source.holds < tokens
            or self.runner.in_batch(id(source))
            or not can_fork(src.layers, tokens)
        ):
            return  # it prefills those tokens itself
        t0 = time.perf_counter()
        start = req.start
        known, tail = _joined(start.known, start.tail).split(tokens)
        layers = self.agents.new_layers()
        fork_layers(src.layers, layers, tokens)
        req.timings.fork_s += time.perf_counter() - t0
        shared = PrefixMatch(MatchKind.SHARED, tokens, len(known.text))
        req.start = Admission(
            state=start.state, source=CacheSource.HOT, match=shared, layers=layers, known=known,
            tail=tail, load_s=start.load_s, prefix_blocks=[], lease=start.lease,
        )  # fmt: skip
        req.prefilled = 0

    def prefill(self, req: Request, n: int) -> None:
        """Run up to ``n`` of the request's new tokens; after the last, sample its first."""
        try:
            t0 = time.perf_counter()
            if req.share is not None:
                self._fork(req)
            start = req.start
            assert start is not None and req.sampler is not None
            ids = start.tail.ids[req.prefilled : req.prefilled + n]
            req.prefilled += len(ids)
            logits = self.runner.prefill(ids, start.layers, last=req.remaining_prefill == 0)
            thin_held(start, self._fork_points(req), self.agents.state_budget)
            if logits is None:
                req.timings.prefill_s += time.perf_counter() - t0
                return
            self._first_token(req, logits, t0)
        except BaseException as exc:
            self.fail(req, exc)

    def _fork_points(self, source: Request) -> list[int]:
        """Where requests waiting on ``source`` will fork it (its snapshots there are kept)."""
        return [r.share[1] for r in self.inflight if r.share is not None and r.share[0] is source]

    def prefill_whole(self, reqs: list[Request]) -> None:
        """The whole remaining prefill of each of ``reqs`` (short: a fan-out's tails after
        their fork, many agents' new turns) in one batched forward pass, then each one's
        first token. One at a time, 56 agents' 15-token turns on the H200 ran 56 forward
        passes of an 8B model before their batch could decode."""
        try:
            t0 = time.perf_counter()
            planned = {id(r): r.remaining_prefill for r in reqs}  # what the scheduler chose by
            for req in reqs:
                if req.share is not None:
                    self._fork(req)
            # A fork that could not be made leaves its request the shared tokens to run
            # too: it goes on in chunks later (one pass of them all could be 32K tokens).
            ready = [
                r
                for r in reqs
                if r.phase is Phase.PREFILL and r.start is not None and r.remaining_prefill <= planned[id(r)]
            ]
            if not ready:
                return
            tails = [r.start.tail.ids[r.prefilled :] for r in ready]  # type: ignore[union-attr]
            logits = self.runner.prefill_whole(
                [(ids, r.start.layers) for ids, r in zip(tails, ready, strict=True)]
            )  # type: ignore[union-attr]
            for i, (req, ids) in enumerate(zip(ready, tails, strict=True)):
                req.prefilled += len(ids)
                thin_held(req.start, self._fork_points(req), self.agents.state_budget)  # type: ignore[arg-type]
                try:
                    self._first_token(req, logits[i], t0)
                except BaseException as exc:
                    self.fail(req, exc)
        except BaseException as exc:
            self._fail_unfinished(reqs, exc)

    def _first_token(self, req: Request, logits: mx.array, t0: float) -> None:
        """The prefill is done: sample the first token, start decoding."""
        assert req.sampler is not None
        token = req.sampler(logits, 0)
        req.timings.prefill_s += time.perf_counter() - t0
        req.timings.ttft_s = time.perf_counter() - req.t_start
        req.phase = Phase.DECODE
        req.decode_t0 = time.perf_counter()
        self._accept(req, token)

    def decode(self, reqs: list[Request]) -> None:
        """One decode step for every decoding request, in one batched forward pass. Without
        a grammar the batch runs one step ahead (``_decode_ahead``); a grammar masks by the
        text so far, so each step's tokens are read before the next is built."""
        if self.decode_ahead and all(r.sampler is not None and r.sampler.constraint is None for r in reqs):
            return self._decode_ahead(reqs)
        for req in reqs:
            if req.ahead is not None:
                self._settle(req)
        reqs = [r for r in reqs if r.phase is Phase.DECODE]
        if not reqs:
            return None
        try:
            with self._finishing_together():
                rows = self.runner.decode([(id(r), r.token, r.start.layers) for r in reqs])  # type: ignore[union-attr]
                # Greedy rows without a grammar: one argmax and one sync for all of them.
                plain = [i for i, r in enumerate(reqs) if r.sampler is not None and r.sampler.greedy]
                greedy = (
                    dict(zip(plain, mx.argmax(rows[mx.array(plain)], axis=-1).tolist(), strict=True))
                    if plain
                    else {}
                )
                for i, req in enumerate(reqs):
                    try:
                        assert req.sampler is not None
                        self._accept(
                            req, greedy[i] if i in greedy else req.sampler(rows[i], len(req.generated))
                        )
                    except BaseException as exc:
                        self.fail(req, exc)
        except BaseException as exc:
            self._fail_unfinished(reqs, exc)

    def _decode_ahead(self, reqs: list[Request]) -> None:
        """One decode step of the batch, as mlx-lm's generators run them: each member's
        draw of the last step (a lazy array, ``Request.ahead``) is fed as this step's token
        and the step is queued before those draws are read, so building the graph (thousands
        of ops in Python) and reading the tokens overlap the model's work instead of following
        it. A member that has just joined feeds its known token; one whose last draw reaches
        max_tokens is not fed (it leaves before the step). A draw that ends a turn was fed
        already: ``_complete`` takes it out of the caches (``LayerCache.unfeed``)."""
        try:
            with self._finishing_together():
                stopped = [r for r in reqs if r.ahead is None and r.cancel.is_set()]
                for r in stopped:  # cancelled with nothing in flight: no step more
                    self._finish(r, "cancelled")
                reqs = [r for r in reqs if r not in stopped]
                drawn = [r for r in reqs if r.ahead is not None]  # draws to read this call
                # Fed: all but a member whose draw in flight is its last (max_tokens reached,
                # or cancelled: that draw is accepted, then it finishes).
                feed = [
                    r
                    for r in reqs
                    if r.ahead is None or (len(r.generated) + 1 < r.max_new and not r.cancel.is_set())
                ]
                tokens = {id(r): r.ahead if r.ahead is not None else r.token for r in feed}
                previous = mx.stack([r.ahead for r in drawn]) if drawn else None  # type: ignore[misc]
                if feed:
                    rows = self.runner.decode([(id(r), tokens[id(r)], r.start.layers) for r in feed])  # type: ignore[union-attr]
                    samplers = [r.sampler for r in feed]
                    if all(s is not None and s.greedy for s in samplers):
                        draws = mx.argmax(rows, axis=-1)  # one op for the whole batch
                    else:  # each its own (seed, step) key: the same draws as decoding alone
                        steps = [len(r.generated) + (r.ahead is not None) for r in feed]
                        draws = mx.stack(
                            [s.lazy(rows[i], n) for i, (s, n) in enumerate(zip(samplers, steps, strict=True))]  # type: ignore[union-attr,misc]
                        )
                    mx.async_eval(draws)
                for r in drawn:
                    r.ahead = None
                for i, r in enumerate(feed):
                    r.ahead = draws[i]
                if previous is None:
                    return
                for req, token in zip(drawn, previous.tolist(), strict=True):
                    try:
                        self._accept(req, token)
                    except BaseException as exc:
                        self.fail(req, exc)
        except BaseException as exc:
            self._fail_unfinished(reqs, exc)

    def _settle(self, req: Request) -> None:
        """Leave the one-step-ahead run (a request with a grammar joins the decode batch):
        accept the draw in flight, so ``token`` is again the next to feed."""
        drawn, req.ahead = req.ahead, None
        assert drawn is not None
        try:
            self._accept(req, int(drawn.item()))
        except BaseException as exc:
            self.fail(req, exc)

    @contextmanager
    def _finishing_together(self) -> Iterator[None]:
        """Requests that finish in one decode step leave the batch together (one copy of the
        batch, not one per leaver: 48 agents ending one turn made 48 copies), then commit."""
        self._finishing = []
        try:
            yield
        finally:
            finishing, self._finishing = self._finishing, None
            if finishing:
                self.runner.leave(*(id(r) for r, _ in finishing))
            for req, finish in finishing:
                try:
                    self._complete(req, finish)
                except BaseException as exc:
                    self.fail(req, exc)

    def _accept(self, req: Request, token: int) -> None:
        """A sampled token: end of turn, a stop sequence, the length limit, a cancel or a
        timeout finish the request; otherwise its text is streamed and it is fed next."""
        assert req.stream is not None
        if len(req.generated) >= req.max_new:
            return self._finish(req, "length")
        if token in self.eos:
            req.ended_by_eos = True
            return self._finish(req, "stop")
        req.generated.append(token)
        new = req.stream.add(token)
        if req.stream.stopped:
            return self._finish(req, "stop")
        if new:
            req.sink.item(StreamChunk(new))
        if len(req.generated) == req.max_new:
            return self._finish(req, "length")
        if req.cancel.is_set():
            return self._finish(req, "cancelled")
        timeout = req.params.timeout_s
        if timeout is not None and time.perf_counter() - req.t_start > timeout:
            return self._finish(req, "timeout")
        req.token = token
        return None

    def _finish(self, req: Request, finish: str) -> None:
        """Finish now, or with the others that finish in this decode step."""
        if self._finishing is not None:
            self._finishing.append((req, finish))
        else:
            self._complete(req, finish)

    def _complete(self, req: Request, finish: str) -> None:
        """Stream the rest of the text, commit the cache, hand over the result."""
        start, stream = req.start, req.stream
        assert start is not None and stream is not None
        rest = stream.finish()
        if stream.stopped:
            finish = "stop"
        req.timings.decode_s = time.perf_counter() - req.decode_t0
        if rest:
            req.sink.item(StreamChunk(rest))
        # Commit the KV of the prompt and of every generated token that went through the
        # model (all but the last sampled one, unless that one was end-of-turn).
        t0 = time.perf_counter()
        self.runner.leave(id(req))  # the others go on without this one
        if req.ahead is not None:  # the last draw went through the model: not kept
            req.ahead = None
            for layer in start.layers:
                layer.unfeed(1)
        known = start.known
        known.extend(start.tail)
        fed = req.generated if req.ended_by_eos else req.generated[:-1]
        if start.layers[0].offset != len(known) + len(fed):
            raise RuntimeError("cache length and token count disagree (this is a bug)")
        gen = token_ends(self.tokenizer, known.ids[-1] if known.ids else None, fed)
        if stream.stopped:  # a stop sequence: keep nothing past it
            gen.truncate(last_clean(gen, sum(1 for e in gen.ends if 0 <= e <= len(stream.text))))
        known.extend(gen)
        save = self.agents.commit(req.agent_id, start, known)
        written = self.committer.commit(save)  # written on the save thread while the reply leaves
        req.timings.save_s = time.perf_counter() - t0
        result = GenerationResult(
            text=stream.text,
            prompt_tokens=start.reused + len(start.tail),
            completion_tokens=len(req.generated) + int(req.ended_by_eos),
            reused_tokens=start.reused,
            outcome=CacheOutcome(start.source, start.outcome_match, start.prefetched),
            finish_reason=finish,
            stop_sequence=stream.stop_sequence,
            timings=req.timings,
            bytes_written=save.nbytes,
            saved="pending",
            save_done=written,
        )
        req.phase = Phase.DONE
        self._forget(req)
        req.sink.item(StreamChunk("", result))
        req.sink.end()

    def fail(self, req: Request, exc: BaseException) -> None:
        self.runner.leave(id(req))
        if req.start is not None and req.start.lease is not None:  # admitted: give the lease back
            req.start.lease.release()
        req.phase = Phase.DONE
        self._forget(req)
        req.sink.error(exc)

    def _fail_unfinished(self, reqs: list[Request], exc: BaseException) -> None:
        """A step of several requests failed: each one it had not finished fails with it."""
        for req in reqs:
            if req.phase is not Phase.DONE:
                self.fail(req, exc)

    def _forget(self, req: Request) -> None:
        if req in self.inflight:
            self.inflight.remove(req)
            self.agents.index.land(req)


def _joined(known: TokenizedText, tail: TokenizedText) -> TokenizedText:
    """``known`` followed by ``tail``, as a new object."""
    full = TokenizedText(known.text, list(known.ids), list(known.ends))
    full.extend(tail)
    return full
