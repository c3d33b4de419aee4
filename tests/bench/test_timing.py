"""time_call's warm-up and run counts (no timing is asserted, only how many calls it makes)."""
from __future__ import annotations

from retrofit.bench.common import WARMUP_RUNS, time_call


def _counter():
    calls = []
    return calls, lambda: calls.append(1)


def test_fast_calls_warm_up_fully_then_time_repeats():
    calls, fn = _counter()
    res = time_call(fn, "cpu", repeats=3, budget_s=30.0)
    assert res["warmup_runs"] == WARMUP_RUNS
    assert len(res["times_s"]) == 3
    assert len(calls) == WARMUP_RUNS + 3


def test_a_run_as_long_as_the_budget_gets_one_warm_up_and_one_timed_run():
    calls, fn = _counter()
    res = time_call(fn, "cpu", repeats=3, budget_s=30.0, first_time=30.0)  # a warm-up already made
    assert res["warmup_runs"] == 1 and len(res["times_s"]) == 1
    assert len(calls) == 1
