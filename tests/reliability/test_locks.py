"""The output lock: one holder at a time, whatever the race; what every writer of an output folder takes."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrofit.fs.locks import LockError, lock_path, output_lock
from retrofit.fs.tempdirs import host_name

_ROUNDS = 12
_WORKERS = 6


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _race(target: str, start, end, holders, most, guard, taken) -> None:
    """One contender: each round, try the lock once at the barrier; while holding it, count the holders."""
    for _ in range(_ROUNDS):
        start.wait()
        try:
            with output_lock(target):
                with guard:
                    holders.value += 1
                    most.value = max(most.value, holders.value)
                    taken.value += 1
                time.sleep(0.05)
                with guard:
                    holders.value -= 1
        except LockError:
            pass
        end.wait()


def test_processes_racing_for_a_stale_lock_never_hold_it_together(tmp_path):
    ctx = multiprocessing.get_context("fork")
    target = tmp_path / "out"
    start, end = ctx.Barrier(_WORKERS + 1), ctx.Barrier(_WORKERS + 1)
    holders, most, taken, guard = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Value("i", 0), ctx.Lock()
    procs = [ctx.Process(target=_race, args=(str(target), start, end, holders, most, guard, taken))
             for _ in range(_WORKERS)]
    for p in procs:
        p.start()
    dead, per_round = _dead_pid(), []
    try:
        for _ in range(_ROUNDS):
            # a killed run's lock: its pid is gone
            lock_path(target).write_text(json.dumps({"pid": dead, "host": host_name(), "time": 0}))
            before = taken.value
            start.wait(timeout=60)
            end.wait(timeout=60)
            per_round.append(taken.value - before)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert most.value == 1, f"{most.value} processes held the lock at once"
    assert all(n >= 1 for n in per_round), per_round  # a stale lock is always taken over
    assert not lock_path(target).exists()


def test_the_lock_is_refused_while_held_and_free_after(tmp_path):
    target = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom retrofit.fs.locks import output_lock\n"
         "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)", str(target)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockError, match=f"pid {holder.pid}"):
            with output_lock(target):
                pass
    finally:
        holder.kill()
        holder.wait()
    with output_lock(target) as lock:  # killed: the kernel released its lock
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_an_empty_lock_file_left_by_a_dead_writer_is_taken_at_once(tmp_path):
    target = tmp_path / "out"
    lock_path(target).write_text("")
    with output_lock(target):
        pass
    assert not lock_path(target).exists()


_FULL_DISK = """
import resource, signal, sys
from retrofit.fs.locks import LockError, output_lock

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # every write fails, as on a full disk
try:
    with output_lock(sys.argv[1]):
        sys.exit("took the lock without writing it")
except LockError as exc:
    print(exc)
"""


def test_a_failed_write_while_taking_the_lock_leaves_no_lock_file_and_names_it(tmp_path):
    target = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(target)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "cannot take the lock" in done.stdout and str(lock_path(target)) in done.stdout, done.stdout
    assert not lock_path(target).exists()
    with output_lock(target):  # the next run is not refused
        pass
