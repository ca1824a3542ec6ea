"""``StepOrder``: the step after next, learned from the nodes each checkpoint names."""

from __future__ import annotations

from langchain_agent_memory.graph.step_order import StepOrder


def test_a_supervisor_is_soon_while_its_worker_runs() -> None:
    order = StepOrder()
    # Thread a shows the pattern once: sup -> w1 -> sup -> w2.
    assert order.saw("a", {"sup"}) == set()
    assert order.saw("a", {"w1"}) == set()
    assert order.saw("a", {"sup"}) == {"w1"}  # after sup came w1 before
    assert order.saw("a", {"w2"}) == set()  # w2 never ran before: nothing known after it
    assert order.saw("a", {"sup"}) == {"w1", "w2"}
    # Another thread of the same graph learns from the first: while w1 runs, sup is soon.
    assert order.saw("b", {"w1"}) == {"sup"}
    # Sends: two workers at once, then the supervisor.
    assert order.saw("b", {"w1", "w2"}) == {"sup"}


def test_a_forgotten_thread_starts_afresh() -> None:
    order = StepOrder()
    order.saw("t", {"plan"})
    order.forget("t")
    order.saw("t", {"review"})  # not noted as following plan
    assert order.saw("u", {"plan"}) == set()
