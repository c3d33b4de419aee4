"""`retrofit bench model`: whole-model throughput, converted vs base.

Per sequence length T and model:

* prefill: ``model(ids)`` under ``torch.no_grad`` with no cache and logits for the last
  position only -> tokens/s = B T / time;
* training step: forward with ``labels=ids`` (the LM loss), backward, ``AdamW.step`` on the
  trainable weights, ``zero_grad`` -> tokens/s. By default the base trains every weight
  (a full fine-tune) and the converted model only what ``convert`` marks trainable (its new
  weights); ``--train-all`` trains every weight of both. ``--loss sliced`` takes the same
  next-token loss through the trainer's sliced LM head (:func:`retrofit.surgery.lm_head.sliced_lm_loss`:
  no ``(B, T, V)`` logits, which for Gemma 3's 262k vocabulary are 17 GB of fp32 at 16K tokens),
  and ``--checkpointing`` recomputes each decoder layer in backward, as the trainer does by
  default (``train.gradient_checkpointing``): together they fit long sequences in memory.

The base runs as loaded (SDPA on CPU): a whole-sequence forward hands its native sliding-window
layers (Gemma 2/3, Mistral) a dense T x T mask, so they do T^2 work. ``--base-attention retrofit``
runs them through the banded O(T w) kernel the converted model's unconverted layers use, which
isolates what conversion itself gains.

Times are medians over ``--repeats`` runs after a warm-up; peak memory is the peak RSS (CPU)
or the CUDA allocator's peak above the start of the step, measured in this process, in a pass of
memory runs before any timed run (see ``run_model_benchmark``). On a CPU the weights are copied
out of the checkpoint's file mapping first (``retrofit.bench.models``).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from retrofit.bench.common import (
    finish_pair_bench,
    hardware_info,
    log_log_axes,
    markdown_table,
    MemoryMeter,
    save_figure_atomic,
    start_run,
    sync,
)
from retrofit.bench.models import build_pair, forward_kwargs
from retrofit.errors import SpecError
from retrofit.patches.attention import install_attention_function
from retrofit.surgery.lm_head import sliced_lm_loss
from retrofit.surgery.recompute import set_activation_checkpointing

__all__ = ["run_model_benchmark"]

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
QUICK_LENGTHS = (256, 512)


def _timed(fn, device, repeats: int) -> tuple[float, list[float]]:
    """Median and all of ``repeats`` timed runs after one warm-up (in the timing malloc mode)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _peak(fn, device) -> int | None:
    """Peak memory of ``fn()`` above its start, from its second run in the exact malloc mode
    (the first settles what a step keeps, e.g. AdamW's state)."""
    for _ in range(2):
        with MemoryMeter(device) as mem:
            fn()
    return mem.peak_bytes


@contextlib.contextmanager
def _step(model, ids, kind: str, args: argparse.Namespace) -> Iterator[tuple[Callable[[], None], int | None] | None]:
    """``(run, trainable parameters or None)`` of one step of ``kind`` (``prefill`` or ``train``),
    None when a training step has nothing to train. A training step puts the model in train mode
    (and activation checkpointing, if asked) until the block ends."""
    if kind == "prefill":
        kw = forward_kwargs(model)

        @torch.no_grad()
        def prefill():
            model(input_ids=ids, use_cache=False, **kw)

        yield prefill, None
        return
    if args.train_all:
        for p in model.parameters():
            p.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        yield None
        return
    opt = torch.optim.AdamW(params, lr=1e-5)
    model.train()
    if args.checkpointing:
        set_activation_checkpointing(model, True)

    def train():
        if args.loss == "sliced":
            value = sliced_lm_loss(model, ids)
        else:
            value = model(input_ids=ids, labels=ids, use_cache=False).loss
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        yield train, sum(p.numel() for p in params)
    finally:
        if args.checkpointing:
            set_activation_checkpointing(model, False)
        model.eval()


def run_model_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    kinds = [kind for kind, on in (("prefill", getattr(args, "prefill", True)), ("train", args.train)) if on]
    if not kinds:
        raise SpecError("--no-prefill and --no-train leave nothing to measure: drop one of them")
    phases = ("memory", "time") if getattr(args, "memory", True) else ("time",)
    device = start_run(args)
    lengths = sorted(args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS))
    repeats = min(args.repeats, 2) if args.quick else args.repeats
    base, converted, info = build_pair(args, max(lengths))
    if getattr(args, "base_attention", "loaded") == "retrofit":
        base.set_attn_implementation(install_attention_function())
    base_attention = base.config._attn_implementation
    info["base"] = f"{info['base']} (attention: {base_attention})"
    hw = hardware_info(device)
    g = torch.Generator().manual_seed(args.seed)
    tasks = [(n, T, kind) for T in lengths for n in ("base", "converted") for kind in kinds]
    inputs = {(T, name): torch.randint(3, int(m.config.vocab_size), (args.batch, T), generator=g).to(device)
              for T in lengths for name, m in (("base", base), ("converted", converted))}
    rows = {task: {"model": task[0], "kind": task[2], "T": task[1]} for task in tasks}
    # Two passes: every memory run before any timed run. A run in the cached malloc mode leaves
    # the heap full of freed blocks; a later run in the exact mode reuses them, faulting them back
    # in, and they stay resident once freed, which inflated 32K peaks by up to 1.3 GiB.
    bar = tqdm(total=len(phases) * len(tasks), desc="bench model", unit="run", disable=args.quiet)
    for phase in phases:
        for name, T, kind in tasks:
            bar.set_postfix_str(f"{phase}: {name} {kind} T={T}")
            row = rows[(name, T, kind)]
            model = base if name == "base" else converted
            if "error" not in row:
                try:
                    with _step(model, inputs[(T, name)], kind, args) as step:
                        if step is None:
                            row["error"] = "no trainable weights"
                        elif phase == "memory":
                            row["peak_bytes"] = _peak(step[0], device)
                        else:
                            t, times = _timed(step[0], device, repeats)
                            row.update(time_s=t, times_s=times, tokens_per_s=args.batch * T / t)
                            if step[1] is not None:
                                row["trainable_parameters"] = step[1]
                except RuntimeError as exc:
                    row["error"] = str(exc).splitlines()[0][:200]
            bar.update()
    bar.close()
    rows = list(rows.values())
    config = {"lengths": lengths, "batch": args.batch, "repeats": repeats, "train_all": args.train_all,
              "loss": args.loss, "checkpointing": args.checkpointing, "base_attention": base_attention,
              "memory_pass": "memory" in phases,
              "device": args.device, "dtype": args.dtype, "backend": args.backend}
    return finish_pair_bench("model", args, hw, info, config, rows, render_table, _plot)


def render_table(report: dict[str, Any]) -> str:
    by = {(r["model"], r["kind"], r["T"]): r for r in report["rows"]}
    rows = []
    for kind in ("prefill", "train"):
        for T in report["config"]["lengths"]:
            b, c = by.get(("base", kind, T)), by.get(("converted", kind, T))
            if b is None and c is None:
                continue
            tps = lambda r: None if r is None else r.get("tokens_per_s")  # noqa: E731
            mib = lambda r: None if r is None or r.get("peak_bytes") is None else r["peak_bytes"] / 2**20  # noqa: E731
            ratio = tps(c) / tps(b) if tps(b) and tps(c) else None
            rows.append([kind, T, tps(b), tps(c), ratio, mib(b), mib(c)])
    return markdown_table(["step", "T", "base tok/s", "converted tok/s", "speedup", "base peak MiB", "converted peak MiB"],
                          rows)


def _plot(report: dict[str, Any], path: Path) -> None:
    from retrofit.extras import require

    matplotlib = require("matplotlib", "plots (PNG files)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, color in (("base", "C0"), ("converted", "C1")):
        for kind, style in (("prefill", "-o"), ("train", "--s")):
            rs = sorted((r for r in report["rows"] if r["model"] == name and r["kind"] == kind and "tokens_per_s" in r),
                        key=lambda r: r["T"])
            if rs:
                ax.plot([r["T"] for r in rs], [r["tokens_per_s"] for r in rs], style, color=color, label=f"{name} {kind}", ms=4)
    log_log_axes([(ax, "tokens / s")], "sequence length T")
    if ax.get_legend_handles_labels()[0]:  # every point failed: no lines, no legend
        ax.legend(fontsize=8)
    ax.set_title(f"whole model: {report['config']['dtype']} on {report['hardware'].get('gpu') or report['hardware']['cpu_model']}",
                 fontsize=9)
    save_figure_atomic(fig, path)
    plt.close(fig)
