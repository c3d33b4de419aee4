"""time_call's warm-up and run counts (no timing is asserted, only how many calls it makes)."""
from __future__ import annotations

import mmap

import pytest

from retrofit.bench import common
from retrofit.bench.common import MAX_WARMUP_RUNS, WARMUP_RUNS, time_call


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


def _growing_heap(calls_that_grow: int):
    """A call that maps and touches 4 MiB of fresh anonymous memory (1024 pages, kept) for its
    first ``calls_that_grow`` calls, as an op's heap grows in its first calls, then allocates
    nothing. It maps pages itself: a tensor could reuse pages an earlier test freed (glibc raises
    its mmap threshold after a free), and huge pages would fault 512 times fewer."""
    calls, kept = [], []
    size = 4 * 2**20

    def fn():
        calls.append(1)
        if len(calls) <= calls_that_grow:
            pages = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                pages.madvise(mmap.MADV_NOHUGEPAGE)
            pages.write(b"\x01" * size)
            kept.append(pages)
    return calls, fn


@pytest.mark.skipif(common._minor_faults() is None, reason="page faults cannot be counted here")
def test_warm_up_goes_on_while_the_heap_still_grows():
    calls, fn = _growing_heap(WARMUP_RUNS + 2)
    res = time_call(fn, "cpu", repeats=2, budget_s=30.0)
    # the calls that grew are all warm-up, plus one that did not (the heap settled)
    assert res["warmup_runs"] == WARMUP_RUNS + 3
    assert res["warmup_faults"] < common.SETTLED_FAULTS
    assert len(calls) == WARMUP_RUNS + 3 + 2


@pytest.mark.skipif(common._minor_faults() is None, reason="page faults cannot be counted here")
def test_warm_up_stops_at_its_cap_when_the_heap_never_settles():
    calls, fn = _growing_heap(10 * MAX_WARMUP_RUNS)
    res = time_call(fn, "cpu", repeats=1, budget_s=30.0)
    assert res["warmup_runs"] == MAX_WARMUP_RUNS
    assert res["warmup_faults"] >= common.SETTLED_FAULTS


def test_without_fault_counts_warm_up_is_the_fixed_count(monkeypatch):
    monkeypatch.setattr(common, "_minor_faults", lambda: None)
    calls, fn = _growing_heap(10 * MAX_WARMUP_RUNS)
    res = time_call(fn, "cpu", repeats=1, budget_s=30.0)
    assert res["warmup_runs"] == WARMUP_RUNS and res["warmup_faults"] is None
