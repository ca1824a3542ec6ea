"""The dashboard's figures over time (``server.history``): replies and disk samples land in
the bucket of their time, a read from a bucket's start on gives it and the later ones, and
the memory is bounded (the oldest buckets dropped)."""

from __future__ import annotations

import pytest

from langchain_agent_memory.server.history import History


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_replies_and_disk_samples_fall_in_buckets_of_their_time() -> None:
    clock = Clock(1000.0)
    h = History(step_s=10, max_buckets=100, clock=clock)
    h.reply("m", "cold", ttft_s=2.0, reused=0, prefilled=500)
    clock.t = 1004.0
    h.reply("m", "hot-extend", ttft_s=0.02, reused=500, prefilled=20)
    h.reply("m", "hot-extend", ttft_s=0.04, reused=520, prefilled=20)
    h.disk("m", 1 << 20, 8 << 20)
    clock.t = 1012.0
    h.reply("m", "warm-shared", ttft_s=0.5, reused=400, prefilled=100)
    h.reply("other", "cold", ttft_s=1.0, reused=0, prefilled=7)

    first, second = h.since(0)["m"]
    assert first["start"] == 1000.0 and second["start"] == 1010.0
    assert first["sources"] == {"cold": 1, "hot": 2}
    assert first["ttft"]["hot-extend"] == {"n": 2, "mean_s": pytest.approx(0.03), "max_s": 0.04}
    assert first["ttft"]["cold"]["n"] == 1
    assert (first["reused"], first["prefilled"]) == (1020, 540)
    assert (first["disk_bytes"], first["disk_budget_bytes"]) == (1 << 20, 8 << 20)
    assert second["sources"] == {"warm": 1} and second["disk_bytes"] is None
    assert [b["start"] for b in h.since(1010.0)["m"]] == [1010.0]  # a page asks from its last one on
    assert h.since(0)["other"][0]["prefilled"] == 7


def test_the_history_is_bounded() -> None:
    clock = Clock(0.0)
    h = History(step_s=1, max_buckets=5, clock=clock)
    for t in range(1000):
        clock.t = float(t)
        h.reply("m", "hot-extend", ttft_s=0.01, reused=1, prefilled=1)
    assert [b["start"] for b in h.since(0)["m"]] == [995.0, 996.0, 997.0, 998.0, 999.0]


def test_a_history_without_room_is_refused() -> None:
    with pytest.raises(ValueError, match="max_buckets"):
        History(max_buckets=0)
