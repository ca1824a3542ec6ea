"""The prefill chunk a request gets: large while it is alone, small once another needs a turn."""

from __future__ import annotations

from dataclasses import dataclass

from langchain_agent_memory.engine.requests.scheduler import Phase, Scheduler


@dataclass(eq=False)
class Job:
    agent_id: str
    tokens: int
    arrival: int = 0
    phase: Phase = Phase.PREFILL
    done: int = 0

    @property
    def remaining_prefill(self) -> int:
        return self.tokens - self.done


def test_a_prefill_alone_takes_the_large_chunk_and_a_new_arrival_makes_it_small() -> None:
    chunks: list[tuple[str, int]] = []

    def prefill(job: Job, n: int) -> None:  # type: ignore[override]
        take = min(n, job.remaining_prefill)
        chunks.append((job.agent_id, take))
        job.done += take
        if not job.remaining_prefill:
            job.phase = Phase.DONE

    s = Scheduler(lambda r: None, prefill, lambda rs: None, chunk_tokens=128, alone_chunk_tokens=256)
    long = Job("long", 1000)
    s.submit(long)
    s.step()
    s.step()
    assert chunks == [("long", 256), ("long", 256)]  # alone: the large chunk
    s.submit(Job("other", 300, arrival=1))
    while s.has_work():
        s.step()
    # Two at once: small chunks (the newcomer first: fewest tokens left); alone again: large.
    assert chunks[2:] == [("other", 128), ("other", 128), ("other", 44), ("long", 256), ("long", 232)]


def test_without_an_alone_chunk_every_chunk_is_the_same() -> None:
    sizes: list[int] = []

    def prefill(job: Job, n: int) -> None:  # type: ignore[override]
        sizes.append(n)
        job.done += min(n, job.remaining_prefill)
        if not job.remaining_prefill:
            job.phase = Phase.DONE

    s = Scheduler(lambda r: None, prefill, lambda rs: None, chunk_tokens=128)
    s.submit(Job("a", 300))
    while s.has_work():
        s.step()
    assert sizes == [128, 128, 44]  # the last asks for what is left
