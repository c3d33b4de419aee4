"""`retrofit bench attention`: the attention ops against PyTorch SDPA causal full attention.

Ops (all through :mod:`retrofit.ops.backends`, so ``--backend`` and ``RETROFIT_BACKEND`` apply):

* ``latte``      causal Latte, chunked (inputs: mixing weights, latent logits, values)
* ``macchiato``  the full Latte Macchiato op: sliding window (state 0) + causal Latte, mixed
* ``swa``        the sliding-window branch alone
* ``exp_linear`` exp(Q)exp(K) linear attention, chunked
* ``delta``      the gated delta rule, chunked (the delta method's memory: L2-normalised q and k,
  write strengths, log-decays)
* ``sdpa``       ``F.scaled_dot_product_attention(..., is_causal=True)``, the baseline

Modes: ``fwd`` (inference forward under ``torch.no_grad``) and ``fwd+bwd`` (forward, then
backward of a fixed random cotangent into every input). Each (op, length) runs in a fresh
worker process (``--no-isolate`` runs in this one): one warm-up run, timed runs (median;
fewer when one run is slow, see ``--max-seconds``), then one run that measures the peak memory.

Memory is the peak above what the inputs already hold (peak RSS on CPU, see
:mod:`retrofit.bench.common`; the CUDA allocator's peak on GPU); ``saved`` is the size of
the tensors autograd keeps for backward (fwd+bwd only), which does not depend on the allocator.

FLOPs are matmul-equivalent counts of each algorithm, per head and token (``d`` = head dim,
``D`` value dim, ``L`` latents, ``C`` chunk, ``w`` window): SDPA causal ``T (d + D)``,
sliding window ``2 w (d + D)``, chunked Latte ``2 (C L + C D + 2 L D)``, exp-linear the same
with ``L = d``; the delta rule ``2 (2 C d + C D + C (d + D) / 2 + 3 d D)`` (the chunk's key
products, its triangular solve and the three state products); backward counts twice the
forward. Efficiency = achieved FLOP/s divided by the FLOP/s of a large matmul measured in the
same run.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from retrofit.bench.common import (
    bench_command,
    hardware_info,
    hardware_line,
    log_log_axes,
    markdown_table,
    matmul_flops,
    MemoryMeter,
    run_worker,
    save_figure_atomic,
    saved_tensor_bytes,
    set_malloc_mode,
    start_run,
    time_call,
    write_bench_results,
)

__all__ = ["OPS", "MODES", "run_attention_benchmark", "measure_point", "op_flops", "render_summary", "render_table"]

OPS = ("latte", "macchiato", "swa", "exp_linear", "delta", "sdpa")
MODES = ("fwd", "fwd+bwd")
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (1024, 2048, 4096)
OP_LABELS = {
    "latte": "causal Latte (chunked)",
    "macchiato": "Macchiato (SWA + Latte)",
    "swa": "sliding window",
    "exp_linear": "exp-linear (chunked)",
    "delta": "gated delta rule (chunked)",
    "sdpa": "SDPA causal (full)",
}
# the torch op whose own chunk_size default applies when --chunk-size is not given (FLOP counts)
_CHUNKED_OP = {"latte": "causal_latte_chunked", "macchiato": "macchiato_attention", "exp_linear": "exp_linear_attention",
               "delta": "delta_rule_chunked"}


def _default_chunk(op: str) -> int:
    """The op's own ``chunk_size`` default (read from its signature, not restated here)."""
    import inspect

    import retrofit.ops

    if op not in _CHUNKED_OP:
        return 64  # unchunked ops: the FLOP formula does not use C
    default = inspect.signature(getattr(retrofit.ops, _CHUNKED_OP[op])).parameters["chunk_size"].default
    if default is None:  # a composition (Macchiato) that keeps its Latte kernel's own default
        return _default_chunk("latte")
    return int(default)


# --------------------------------------------------------------------------------------
# one point


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _build(op: str, T: int, cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, grad: bool):
    """``(inputs, fn)``: fn(*inputs) -> output tensor of shape (B, H, T, d)."""
    from retrofit import ops

    B, H, d, L, w = cfg["batch"], cfg["heads"], cfg["head_dim"], cfg["latents_per_head"], cfg["window"]
    chunk = {} if cfg.get("chunk_size") is None else {"chunk_size": cfg["chunk_size"]}
    g = torch.Generator(device="cpu").manual_seed(cfg.get("seed", 0))

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    if op == "latte":
        inputs = [torch.softmax(rnd(B, H, T, L).float(), -1).to(dtype), rnd(B, H, T, L), rnd(B, H, T, d)]
        fn = lambda qw, a, v: ops.causal_latte_chunked(qw, a, v, **chunk)[0]  # noqa: E731
    elif op == "macchiato":
        inputs = [rnd(B, H, T, d), rnd(B, H, T, d), rnd(B, H, T, d), rnd(B, H, T, L + 1), rnd(B, H, T, L)]
        fn = lambda q, k, v, mix, lat: ops.macchiato_attention(q, k, v, mix, lat, window=w, **chunk)[0]  # noqa: E731
    elif op == "swa":
        inputs = [rnd(B, H, T, d), rnd(B, H, T, d), rnd(B, H, T, d)]
        fn = lambda q, k, v: ops.sliding_window_attention(q, k, v, w)  # noqa: E731
    elif op == "exp_linear":
        inputs = [rnd(B, H, T, d, scale=0.5), rnd(B, H, T, d, scale=0.5), rnd(B, H, T, d)]
        fn = lambda q, k, v: ops.exp_linear_attention(q, k, v, **chunk)[0]  # noqa: E731
    elif op == "delta":  # unit-norm keys and queries, beta in (0, 1), a decay halving over ~700 tokens
        unit = lambda x: torch.nn.functional.normalize(x.float(), dim=-1).to(dtype)  # noqa: E731
        inputs = [unit(rnd(B, H, T, d)), unit(rnd(B, H, T, d)), rnd(B, H, T, d),
                  torch.sigmoid(rnd(B, H, T).float()), torch.full((B, H, T), -1e-3, device=device)]
        fn = lambda q, k, v, beta, g: ops.delta_rule_chunked(q, k, v, beta, g, **chunk)[0]  # noqa: E731
    elif op == "sdpa":
        inputs = [rnd(B, H, T, d), rnd(B, H, T, d), rnd(B, H, T, d)]
        fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    if grad:
        for x in inputs:
            x.requires_grad_(True)
    return inputs, fn


def _backend_ran(op: str, device: torch.device, dtype: torch.dtype, cfg: dict[str, Any]) -> str:
    from retrofit.ops.backends import resolve_backend

    if op == "sdpa":
        return "torch sdpa"
    swa = lambda: resolve_backend(  # noqa: E731
        "sliding_window_attention", device, dtype, head_dim=cfg["head_dim"], value_dim=cfg["head_dim"]
    )
    if op == "swa":
        return swa()
    if op in ("exp_linear", "delta"):
        return resolve_backend(_CHUNKED_OP[op], device, dtype)
    latte = resolve_backend("causal_latte_chunked", device, dtype)
    return f"{swa()}+{latte}" if op == "macchiato" else latte


def measure_point(payload: dict[str, Any]) -> dict[str, Any]:
    """Measure one (op, T) in this process for each requested mode. Returns a JSON-able dict."""
    from retrofit.ops.backends import set_default_backend

    op, T, cfg = payload["op"], int(payload["T"]), payload["cfg"]
    device, dtype = torch.device(cfg["device"]), _dtype(cfg["dtype"])
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    set_malloc_mode(cfg.get("malloc", "cached"))
    set_default_backend(cfg.get("backend"))
    out: dict[str, Any] = {"op": op, "T": T, "backend": _backend_ran(op, device, dtype, cfg), "modes": {}}
    for mode in payload["modes"]:
        grad = mode == "fwd+bwd"
        inputs, fn = _build(op, T, cfg, device, dtype, grad)
        cot = torch.randn(cfg["batch"], cfg["heads"], T, cfg["head_dim"], generator=torch.Generator().manual_seed(1))
        cot = cot.to(device=device, dtype=dtype)
        saved = {"bytes": None}

        def run(record_saved: bool = False):
            if not grad:
                with torch.no_grad():
                    return fn(*inputs)
            for x in inputs:
                x.grad = None
            if record_saved:
                with saved_tensor_bytes() as s:
                    y = fn(*inputs)
                saved["bytes"] = s["bytes"]
            else:
                y = fn(*inputs)
            y.backward(cot)

        # warm-up (one-time costs: autograd engine, workspaces, lazy inits), timed runs, then
        # one run under the memory meter (which changes malloc settings, so it comes last)
        timing = time_call(run, device, repeats=cfg["repeats"], budget_s=cfg["budget_s"])
        with MemoryMeter(device) as mem:
            run(record_saved=True)
        out["modes"][mode] = {
            **timing,
            "peak_bytes": mem.peak_bytes,
            "memory_method": mem.method,
            "saved_bytes": saved["bytes"],
        }
        del inputs
    return out


def op_flops(op: str, mode: str, T: int, cfg: dict[str, Any]) -> float:
    """Matmul-equivalent FLOPs of one call (see the module docstring)."""
    B, H, d, L, w = cfg["batch"], cfg["heads"], cfg["head_dim"], cfg["latents_per_head"], cfg["window"]
    D = d
    C = min(cfg.get("chunk_size") or _default_chunk(op), T)
    per_token = {
        "sdpa": T * (d + D),
        "swa": 2 * min(w, T) * (d + D),
        "latte": 2 * (C * L + C * D + 2 * L * D),
        "exp_linear": 2 * (C * d + C * D + 2 * d * D),
        "delta": 2 * (2 * C * d + C * D + C * (d + D) / 2 + 3 * d * D),
        "macchiato": 2 * min(w, T) * (d + D) + 2 * (C * L + C * D + 2 * L * D),
    }[op]
    return B * H * T * per_token * (3 if mode == "fwd+bwd" else 1)


# --------------------------------------------------------------------------------------
# the whole table


def _config(args: argparse.Namespace) -> dict[str, Any]:
    from retrofit.bench.defaults import bench_latents
    from retrofit.layers.method import DEFAULT_WINDOW

    latents = bench_latents(args.latents, args.heads)  # L in total, as everywhere (--latents)
    return {
        "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "latents": latents,
        "latents_per_head": latents // args.heads,
        "window": args.window if args.window is not None else DEFAULT_WINDOW, "chunk_size": args.chunk_size, "dtype": args.dtype, "device": args.device,
        "repeats": args.repeats, "budget_s": args.max_seconds, "backend": args.backend, "seed": args.seed,
        "threads": args.threads, "malloc": getattr(args, "malloc", "cached"),
    }


def run_attention_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the table, print it, write results.json, results.md and attention.png under ``args.out``."""
    from tqdm import tqdm

    from retrofit.errors import SpecError

    if args.lengths is None:
        args.lengths = list(QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    ops = args.ops or list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SpecError(f"unknown op(s) {', '.join(bad)}: choose from {', '.join(OPS)}")
    modes = args.modes or list(MODES)
    device = start_run(args)
    cfg = _config(args)
    dtype = _dtype(args.dtype)
    out_dir = Path(args.out)

    hw = hardware_info(device)
    ref_flops = [matmul_flops(device, dtype)]
    points = [(op, T) for T in sorted(args.lengths) for op in ops if not (op == "sdpa" and T > args.sdpa_max_length)]
    results: list[dict[str, Any]] = []
    bar = tqdm(points, desc="bench attention", unit="point", disable=args.quiet)
    for op, T in bar:
        bar.set_postfix_str(f"{op} T={T}")
        payload = {"op": op, "T": T, "cfg": cfg, "modes": modes}
        if args.isolate:
            res = run_worker("retrofit.bench.attention", payload, timeout=args.point_timeout)
            res.setdefault("op", op)
            res.setdefault("T", T)
        else:
            try:
                res = measure_point(payload)
            except RuntimeError as exc:  # e.g. out of memory at the largest lengths
                res = {"op": op, "T": T, "error": str(exc).splitlines()[0]}
        results.append(res)
        # after every point from the first measured one on, so a run stopped by a time limit keeps what it measured
        if any("modes" in r for r in results):
            _write_report(out_dir, results, cfg, modes, hw, ref_flops, args, complete=False)
    if results and not any("modes" in r for r in results):  # a table of errors alone is no result: fail, writing
        raise _nothing_measured(results, args)               # nothing
    ref_flops.append(matmul_flops(device, dtype))

    report, table = _write_report(out_dir, results, cfg, modes, hw, ref_flops, args, complete=True)
    _plot(report, out_dir / "attention.png")
    if not args.quiet:
        print(f"\n{hardware_line(hw)}")
        print(f"reference matmul: {max(ref_flops) / 1e9:.1f} GFLOP/s ({args.dtype})\n")
        print(table)
        for line in _check_lines(report):
            print(line)
        print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'results.md'}, {out_dir / 'attention.png'}")
    return report


def _nothing_measured(results: list[dict[str, Any]], args: argparse.Namespace) -> Exception:
    """The error of a run in which no point finished: a --point-timeout below what a worker needs, or the
    first point's failure."""
    from retrofit.errors import RetrofitError

    timed_out = [str(r.get("error", "")).startswith("timed out") for r in results]
    if all(timed_out):
        return RetrofitError(f"no point finished within --point-timeout {args.point_timeout:g} s (each runs in a "
                             "fresh worker process, whose start alone takes seconds): pass a larger --point-timeout "
                             "(the default is 3600) or --no-isolate")
    first = results[timed_out.index(False)]
    more = f" (and {len(results) - 1} more points)" if len(results) > 1 else ""
    return RetrofitError(f"no point was measured: {first.get('op')} at T={first.get('T')} failed: "
                         f"{first.get('error', 'failed')}{more}; fix that or choose other --ops / --lengths")


def _write_report(out_dir: Path, results, cfg, modes, hw, ref_flops, args, *, complete: bool):
    """Write results.json / results.md for the points measured so far (``complete``: all of them)."""
    from retrofit.ops.backends import available_backends

    report = _assemble(results, cfg, modes, hw, max(ref_flops), ref_flops, args)
    report["backends_installed"] = available_backends()
    report["complete"] = complete
    out_dir.mkdir(parents=True, exist_ok=True)
    table = render_table(report)
    write_bench_results(out_dir, report, _markdown_report(report, table))
    return report, table


def _assemble(results, cfg, modes, hw, ref, ref_all, args) -> dict[str, Any]:
    sdpa = {(r["T"], m): r["modes"][m]["time_s"] for r in results if r.get("op") == "sdpa" and "modes" in r for m in r["modes"]}
    rows = []
    for r in results:
        if "modes" not in r:
            rows.append({"op": r["op"], "T": r["T"], "error": r.get("error", "failed")})
            continue
        for mode, m in r["modes"].items():
            flops = op_flops(r["op"], mode, r["T"], cfg)
            base = sdpa.get((r["T"], mode))
            rows.append({
                "op": r["op"], "mode": mode, "T": r["T"], "backend": r.get("backend"),
                "time_s": m["time_s"], "times_s": m["times_s"], "warmup_s": m["warmup_s"],
                "warmup_runs": m.get("warmup_runs"), "warmup_faults": m.get("warmup_faults"),
                "speedup_vs_sdpa": None if base is None else base / m["time_s"],
                "peak_bytes": m["peak_bytes"], "memory_method": m["memory_method"], "saved_bytes": m["saved_bytes"],
                "flops": flops, "flops_per_s": flops / m["time_s"], "efficiency": flops / m["time_s"] / ref,
            })
    report = {
        "suite": "attention",
        "command": bench_command(),
        "hardware": hw,
        "config": {**cfg, "lengths": sorted(args.lengths), "ops": sorted({r["op"] for r in results}), "modes": modes,
                   "isolate": args.isolate},
        "reference_matmul_flops_per_s": ref,
        "reference_matmul_samples": ref_all,
        "rows": rows,
    }
    report["checks"] = _checks(report)
    return report


def _row(report, op, mode, T):
    return next((r for r in report["rows"] if r["op"] == op and r.get("mode") == mode and r["T"] == T), None)


def _checks(report) -> list[dict[str, Any]]:
    """The pass / fail targets of the attention ops, evaluated where the table has the points: Latte
    forward >= 25x and Macchiato forward+backward >= 10x faster than SDPA at T = 16K, Latte faster than
    SDPA at every length, and each op's peak memory linear in T (log-log slope < 1.25; SDPA's for reference)."""
    checks = []
    for op, mode, T, target in (("latte", "fwd", 16384, 25.0), ("macchiato", "fwd+bwd", 16384, 10.0)):
        r = _row(report, op, mode, T)
        if r and r.get("speedup_vs_sdpa"):
            checks.append({"check": f"{op} {mode} at T={T} >= {target:g}x faster than SDPA",
                           "value": round(r["speedup_vs_sdpa"], 2), "pass": r["speedup_vs_sdpa"] >= target})
    lat = sorted((r for r in report["rows"] if r["op"] == "latte" and r.get("speedup_vs_sdpa")), key=lambda r: (r["mode"], r["T"]))
    for mode in MODES:
        rs = [r for r in lat if r["mode"] == mode]
        if rs:
            worst = min(rs, key=lambda r: r["speedup_vs_sdpa"])
            checks.append({"check": f"latte {mode} faster than SDPA at every T >= {rs[0]['T']}",
                           "value": f"min {worst['speedup_vs_sdpa']:.2f}x at T={worst['T']}",
                           "pass": worst["speedup_vs_sdpa"] > 1.0})
    for op in report["config"]["ops"]:
        for mode in MODES:
            slope = _memory_exponent(report, op, mode)
            if slope is not None:
                checks.append({"check": f"{op} {mode} memory linear in T (log-log slope)",
                               "value": round(slope, 2), "pass": slope < 1.25 if op != "sdpa" else None})
    return checks


def _memory_exponent(report, op, mode) -> float | None:
    pts = [(r["T"], r["peak_bytes"]) for r in report["rows"]
           if r["op"] == op and r.get("mode") == mode and r.get("peak_bytes") and r["T"] >= 2048]
    if len(pts) < 2:
        return None
    xs = [math.log(t) for t, _ in pts]
    ys = [math.log(b) for _, b in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def _check_lines(report) -> list[str]:
    lines = []
    for c in report["checks"]:
        mark = {True: "PASS", False: "FAIL", None: "info"}[c["pass"]]
        lines.append(f"[{mark}] {c['check']}: {c['value']}")
    return lines


def render_table(report) -> str:
    headers = ["op", "mode", "T", "backend", "time ms", "x SDPA", "peak MiB", "saved MiB", "GFLOP/s", "eff"]
    rows = []
    for r in sorted(report["rows"], key=lambda r: (OPS.index(r["op"]), r.get("mode", ""), r["T"])):
        if "error" in r:
            rows.append([r["op"], "-", r["T"], "-", r["error"][:40], None, None, None, None, None])
            continue
        mib = lambda b: None if b is None else b / 2**20  # noqa: E731
        rows.append([
            r["op"], r["mode"], r["T"], r["backend"], r["time_s"] * 1e3, r["speedup_vs_sdpa"],
            mib(r["peak_bytes"]), mib(r["saved_bytes"]), r["flops_per_s"] / 1e9, r["efficiency"],
        ])
    return markdown_table(headers, rows)


def render_summary(report) -> str:
    """One row per (op, mode), one column per T: ``time (x SDPA)``; then peak memory in MiB."""
    lengths = sorted({r["T"] for r in report["rows"]})
    by = {(r["op"], r.get("mode"), r["T"]): r for r in report["rows"]}
    rows = []
    for op in OPS:
        for mode in MODES:
            cells = []
            for T in lengths:
                r = by.get((op, mode, T))
                if r is None or "time_s" not in r:
                    cells.append(None)
                    continue
                x = f" ({r['speedup_vs_sdpa']:.2f}x)" if r.get("speedup_vs_sdpa") and op != "sdpa" else ""
                cells.append(f"{r['time_s']:.3g} s{x}")
            if any(c is not None for c in cells):
                rows.append([op, mode, *cells])
    head = ["op", "mode", *[f"T={T}" for T in lengths]]
    mem_rows = []
    for op in OPS:
        for mode in MODES:
            cells = [by.get((op, mode, T), {}).get("peak_bytes") for T in lengths]
            if any(c is not None for c in cells):
                mem_rows.append([op, mode, *[None if c is None else f"{c / 2**20:.0f}" for c in cells]])
    return (markdown_table(head, rows) + "\n\nPeak memory above the inputs (MiB):\n\n"
            + markdown_table(head, mem_rows))


def _markdown_report(report, table) -> str:
    cfg = report["config"]
    return "\n".join([
        "# retrofit bench attention",
        "",
        f"Hardware: {hardware_line(report['hardware'])}",
        f"Config: B={cfg['batch']} H={cfg['heads']} head_dim={cfg['head_dim']} L={cfg['latents']} "
        f"(L_h={cfg['latents_per_head']}) w={cfg['window']} chunk={cfg['chunk_size'] or 'op default'} dtype={cfg['dtype']} device={cfg['device']} "
        f"malloc={cfg.get('malloc', 'cached')}",
        f"Reference matmul: {report['reference_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s",
        "",
        "Time per call (speed-up over SDPA causal at the same T and mode):",
        "",
        render_summary(report),
        "",
        "All measurements:",
        "",
        table,
        "",
        *[f"- {line}" for line in _check_lines(report)],
        "",
    ])


def _plot(report, path: Path) -> None:
    from retrofit.extras import require

    matplotlib = require("matplotlib", "plots (PNG files)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = dict(zip(OPS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for op in OPS:
        for mode, style in (("fwd", "-o"), ("fwd+bwd", "--s")):
            rs = sorted((r for r in report["rows"] if r["op"] == op and r.get("mode") == mode), key=lambda r: r["T"])
            if not rs:
                continue
            label = f"{OP_LABELS[op]} {mode}"
            ax_t.plot([r["T"] for r in rs], [r["time_s"] for r in rs], style, color=colors[op], label=label, ms=4)
            mem = [(r["T"], r["peak_bytes"] / 2**20) for r in rs if r.get("peak_bytes")]
            if mem:
                ax_m.plot(*zip(*mem), style, color=colors[op], label=label, ms=4)
    log_log_axes(((ax_t, "time per call (s)"), (ax_m, "peak memory above inputs (MiB)")), "sequence length T")
    if ax_t.get_legend_handles_labels()[0]:  # every point failed or timed out: no lines, no legend
        ax_t.legend(fontsize=7)
    cfg = report["config"]
    fig.suptitle(
        f"attention ops vs SDPA causal - B={cfg['batch']} H={cfg['heads']} d={cfg['head_dim']} "
        f"L={cfg['latents']} (L_h={cfg['latents_per_head']}) w={cfg['window']} {cfg['dtype']} on {report['hardware'].get('gpu') or report['hardware']['cpu_model']}",
        fontsize=9,
    )
    save_figure_atomic(fig, path)
    plt.close(fig)


def _worker_main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m retrofit.bench.attention --worker JSON", file=sys.stderr)
        return 2
    payload = json.loads(argv[1])
    try:
        res = measure_point(payload)
    except RuntimeError as exc:
        res = {"op": payload["op"], "T": payload["T"], "error": str(exc).splitlines()[0][:300]}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
