"""Shared pieces of the benchmark suites: timing, memory, hardware facts, atomic result files.

Memory on CPU is the peak resident set size (RSS) above a baseline, read from Linux's
``/proc/self/status`` (``VmHWM`` = peak RSS since the last reset; writing ``5`` to
``/proc/self/clear_refs`` resets it). Freed memory only leaves the RSS if malloc returns it to
the OS, so for the measured block :class:`MemoryMeter` switches glibc to mmap every allocation
of 64 KiB or more (``mallopt``; unmapped on free) and trims the heap first: the RSS then
follows live tensor memory. Timed runs happen outside the meter, under the malloc mode the
suite was given (:func:`set_malloc_mode`): ``cached`` (default) keeps freed blocks for reuse,
as jemalloc / tcmalloc (PyTorch's CPU tuning advice) or PyTorch's own CUDA caching allocator
do; ``system`` is glibc's default, where every allocation of 32 MiB or more is a fresh mmap
whose pages fault in on first touch, which taxes ops with large temporaries.
On CUDA it is ``torch.cuda.max_memory_allocated`` above the allocation at the start.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from retrofit.fs.atomic import save_figure_atomic
from retrofit.results import markdown_table as _markdown_table, write_results

__all__ = [
    "MALLOC_MODES",
    "MemoryMeter",
    "hardware_info",
    "matmul_flops",
    "markdown_table",
    "run_worker",
    "set_malloc_mode",
    "sync",
    "time_call",
    "bench_command",
    "finish_pair_bench",
    "log_log_axes",
    "save_figure_atomic",
    "write_bench_results",
]

# glibc mallopt parameters and defaults (64-bit)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_MMAP_MAX = 65536
MALLOC_MODES = ("cached", "system")
_malloc_mode = "system"


def _libc():
    try:
        import ctypes

        lib = ctypes.CDLL("libc.so.6")
        lib.mallopt, lib.malloc_trim  # noqa: B018 - both must exist (glibc)
        return lib
    except (OSError, AttributeError):
        return None


def set_malloc_mode(mode: str) -> bool:
    """Allocator behaviour for timed runs in this process (glibc only; elsewhere a no-op).

    ``cached``: no mmaps and no heap trimming, so freed blocks are reused without page faults.
    ``system``: glibc's defaults. Returns whether the setting took effect.
    """
    global _malloc_mode
    if mode not in MALLOC_MODES:
        raise ValueError(f"malloc mode {mode!r}: choose from {', '.join(MALLOC_MODES)}")
    _malloc_mode = mode
    lib = _libc()
    if lib is None:
        return False
    if mode == "cached":
        return bool(lib.mallopt(_M_MMAP_MAX, 0) and lib.mallopt(_M_TRIM_THRESHOLD, 2**30))
    return bool(lib.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX) and lib.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
                and lib.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20))


def _malloc_exact(on: bool) -> bool:
    """on: mmap every allocation >= 64 KiB and trim the heap; off: back to the timing mode."""
    lib = _libc()
    if lib is None:
        return False
    if on:
        ok = (lib.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX) and lib.mallopt(_M_MMAP_THRESHOLD, 65536)
              and lib.mallopt(_M_TRIM_THRESHOLD, 0))
        lib.malloc_trim(0)
        return bool(ok)
    return set_malloc_mode(_malloc_mode)


def sync(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------
# timing


# Warm-up before timing (see time_call): at least WARMUP_RUNS runs while they fit in a quarter of
# the budget; on a CPU, further runs (up to MAX_WARMUP_RUNS, within half the budget) while a run
# still takes SETTLED_FAULTS or more minor page faults, i.e. while the heap is still growing.
WARMUP_RUNS = 4
MAX_WARMUP_RUNS = 8
SETTLED_FAULTS = 256  # 1 MiB of 4 KiB pages


def time_call(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    repeats: int = 3,
    budget_s: float = 30.0,
    first_time: float | None = None,
) -> dict[str, Any]:
    """Median wall time of ``fn()`` over warm runs.

    ``first_time``: the duration of a run already made (a warm-up); without it one warm-up
    run is made first. On a CPU the first calls of an op that allocates large temporaries grow
    the allocator's heap, and each new page faults in on first touch, a cost a training or
    prefill loop pays once: at 16K, Macchiato's forward+backward took 436k, 196k, 33k, 257
    and 0 minor faults in its first five calls (2.5, 2.4, 1.3, 1.0, 1.1 s). So warm-up goes on
    while runs still fault (see ``MAX_WARMUP_RUNS``); where faults cannot be counted (CUDA,
    no ``resource`` module) it makes ``WARMUP_RUNS`` runs within a quarter of the budget. The
    number of timed runs adapts to the budget: ``min(repeats, budget_s / first_time)``, at least
    one. Returns ``time_s`` (median), ``times_s``, ``warmup_s`` (the first run), ``warmup_runs``
    and ``warmup_faults`` (minor faults of the last warm-up run; None when not counted).
    """
    counts_faults = torch.device(device).type == "cpu" and _minor_faults() is not None
    faults = None
    if first_time is None:
        first_time, faults = _timed_faults(fn, device, counts_faults)
    warm, spent = 1, first_time

    def more() -> bool:
        if warm < WARMUP_RUNS and spent + first_time < budget_s / 4:
            return True
        growing = counts_faults and (faults is None or faults >= SETTLED_FAULTS)
        return growing and warm < MAX_WARMUP_RUNS and spent + first_time < budget_s / 2

    while more():
        t, faults = _timed_faults(fn, device, counts_faults)
        spent += t
        warm += 1
    n = int(max(1, min(repeats, budget_s // max(first_time, 1e-9))))
    times = [_timed(fn, device) for _ in range(n)]
    return {"time_s": statistics.median(times), "times_s": times, "warmup_s": first_time, "warmup_runs": warm,
            "warmup_faults": faults}


def _minor_faults() -> int | None:
    """Minor page faults of this process so far (None where the platform cannot tell)."""
    try:
        import resource
    except ImportError:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def _timed_faults(fn: Callable[[], Any], device: torch.device | str, count: bool) -> tuple[float, int | None]:
    """``(seconds, minor page faults or None)`` of one call."""
    before = _minor_faults() if count else None
    t = _timed(fn, device)
    return t, None if before is None else _minor_faults() - before


def _timed(fn: Callable[[], Any], device: torch.device | str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def matmul_flops(device: torch.device | str, dtype: torch.dtype, *, n: int | None = None, repeats: int = 5) -> float:
    """Best FLOP/s of an ``n x n`` matmul (n = 2048 on CPU, 8192 on CUDA): the machine's reference rate."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)
    best = min(_timed(lambda: torch.matmul(a, b), device) for _ in range(repeats))
    return 2.0 * n**3 / best


# --------------------------------------------------------------------------------------
# memory


def _proc_status() -> dict[str, int] | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    out = {}
    for key in ("VmRSS", "VmHWM"):
        m = re.search(rf"^{key}:\s+(\d+)\s+kB", text, re.M)
        if m:
            out[key] = int(m.group(1)) * 1024
    return out if len(out) == 2 else None


class MemoryMeter:
    """Peak memory of a block above the memory in use when it starts.

    ``with MemoryMeter(device) as m: ...`` then ``m.peak_bytes`` (None when the platform
    cannot tell) and ``m.method`` (what was measured).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self.method = "none"

    def __enter__(self) -> "MemoryMeter":
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated"
        else:
            exact = _malloc_exact(True)
            self._resettable = self._reset_hwm()
            status = _proc_status()
            self._base = None if status is None else status["VmRSS"]
            if self._resettable and status:
                self.method = "peak RSS (VmHWM)" + ("" if exact else ", malloc caching not disabled")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            if self.method != "none":
                status = _proc_status()
                self.peak_bytes = None if status is None else max(0, status["VmHWM"] - self._base)
            _malloc_exact(False)

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False


@contextlib.contextmanager
def saved_tensor_bytes() -> Iterable[dict[str, int]]:
    """Bytes of the distinct storages autograd saves for backward inside the block."""
    seen: dict[tuple, int] = {}
    total = {"bytes": 0}

    def pack(t: torch.Tensor):
        try:
            key = (t.untyped_storage().data_ptr(), t.device.type)
            if key not in seen:
                seen[key] = t.untyped_storage().nbytes()
                total["bytes"] += seen[key]
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


# --------------------------------------------------------------------------------------
# facts about the machine


def hardware_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """CPU model and cores (lscpu), torch version and threads, GPU name when on CUDA, date."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_model": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["cpu_model"] = value.strip()
            elif key.strip() == "CPU(s)":
                info["cpu_count"] = int(value.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def hardware_line(info: dict[str, Any]) -> str:
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    load = f", load avg {info['load_average'][0]}" if info.get("load_average") else ""
    return (
        f"{info['cpu_model']} ({info['cpu_count']} CPUs, {info['torch_threads']} torch threads){gpu}; "
        f"torch {info['torch']}; {info['date']}{load}"
    )


# --------------------------------------------------------------------------------------
# files and tables


def write_bench_results(out: str | Path, report: dict, markdown: str) -> tuple[Path, Path]:
    """A bench's ``results.json`` and ``results.md`` in ``out`` (atomic)."""
    return write_results(out, report, markdown, markdown_name="results.md", finite=False, json_default=str)


def start_run(args: Any) -> torch.device:
    """The set-up every suite shares: refuse ``--device cuda`` without CUDA, apply ``--threads``
    and ``--malloc`` (default cached), and seed torch with ``--seed``; returns the device."""
    from retrofit.errors import SpecError

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    set_malloc_mode(getattr(args, "malloc", "cached"))
    torch.manual_seed(args.seed)
    return torch.device(args.device)


def bench_command() -> str | None:
    """The ``retrofit ...`` command line of this run (None when not run through the console script)."""
    return " ".join(["retrofit", *sys.argv[1:]]) if Path(sys.argv[0]).name == "retrofit" else None


def finish_pair_bench(suite: str, args: Any, hw: dict, info: dict, config: dict, rows: list[dict],
                      render_table: Callable[[dict], str], plot: Callable[[dict, Path], Any]) -> dict[str, Any]:
    """A base-vs-converted bench (``model``, ``decode``): its report dict, written as results.json,
    results.md and ``<suite>.png`` under ``args.out``, and printed unless ``args.quiet``."""
    report = {"suite": suite, "command": bench_command(), "hardware": hw, "models": info, "config": config,
              "rows": rows}
    out = Path(args.out)
    table = render_table(report)
    write_bench_results(out, report, "\n".join([
        f"# retrofit bench {suite}", "", f"Hardware: {hardware_line(hw)}",
        f"Base: {info['base']}", f"Converted: {info['converted']}", "", table, "",
    ]))
    plot(report, out / f"{suite}.png")
    if not args.quiet:
        print(f"\n{hardware_line(hw)}\nbase: {info['base']}\nconverted: {info['converted']}\n")
        print(table)
        print(f"\nwrote {out / 'results.json'}, {out / 'results.md'}, {out / f'{suite}.png'}")
    return report


def log_log_axes(axes_and_labels: Iterable[tuple[Any, str]], xlabel: str) -> None:
    """Log2 x, log y, labels and a light grid on each ``(ax, ylabel)``: the bench plots' common frame."""
    for ax, ylabel in axes_and_labels:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A bench table: right-aligned, padded columns, numbers to 2-3 significant digits."""
    return _markdown_table(headers, rows, ["r"] * len(headers), pad=True, cell=_fmt)


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:
            return "-"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.3g}"
    return str(x)


def run_worker(module: str, payload: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
    """Run ``python -m <module> --worker '<json>'`` in a fresh process; its last stdout line is JSON."""
    env = dict(os.environ)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, "--worker", json.dumps(payload)],
            capture_output=True, text=True, env=env, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
        return {"error": f"worker {why}: {' | '.join(tail)}"}
    return json.loads(lines[-1])
