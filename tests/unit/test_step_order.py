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


def test_the_worker_after_a_supervisor_is_told_by_the_worker_before() -> None:
    """A supervisor that routes to many workers: the last two steps say which comes next
    (``w3 -> sup`` was followed by ``w4``), not every worker it was ever seen to route to."""
    order = StepOrder()
    workers = [f"w{i}" for i in range(1, 7)]
    for w in workers:  # the first round: sup -> w1 -> sup -> w2 -> ...
        order.saw("t", {"sup"})
        order.saw("t", {w})
    order.saw("t", {"sup"})
    order.saw("t", {"review"})
    order.forget("t")  # the thread ends; the next round starts afresh
    assert order.saw("t", {"sup"}) == set()  # six workers seen after sup: too many to load
    assert order.saw("t", {"w1"}) == {"sup"}
    assert order.saw("t", {"sup"}) == {"w2"}  # after w1 -> sup came w2
    assert order.saw("t", {"w2"}) == {"sup"}
    assert order.saw("t", {"sup"}) == {"w3"}
    # The routing changes: the prediction follows what was seen last.
    assert order.saw("t", {"w5"}) == {"sup"}
    assert order.saw("t", {"sup"}) == {"w6"}
    assert order.saw("t", {"w3"}) == {"sup"}
    assert order.saw("u", {"w5"}) == {"sup"}
    assert order.saw("u", {"sup"}) == {"w3"}  # w5 -> sup -> w3 was seen last, in thread t


def test_the_first_node_of_a_thread_s_next_run_is_predicted() -> None:
    """A round ends at a human's review; the next run starts at the supervisor again and its
    first worker is the one the last round started with."""
    order = StepOrder()
    for _ in range(2):
        order.saw("t", {"sup"})
        order.saw("t", {"w1"})
        order.saw("t", {"sup"})
        order.saw("t", {"review"})
        order.saw("t", set())  # the run ended: nothing pending
    assert order.saw("t", {"sup"}) == {"w1"}


def test_a_forgotten_thread_starts_afresh() -> None:
    order = StepOrder()
    order.saw("t", {"plan"})
    order.forget("t")
    order.saw("t", {"review"})  # not noted as following plan
    assert order.saw("u", {"plan"}) == set()
