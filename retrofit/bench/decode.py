"""`retrofit bench decode`: per-token decoding latency vs context length, converted vs base.

For each context length T and each model: prefill T random tokens (in chunks of
``--prefill-chunk``, with the model's cache), then time ``--new-tokens`` single-token
forward steps that extend the cache (greedy: each step feeds the previous argmax). The
converted model's cache is retrofit's constant-memory one (the converted layers adopt the
``DynamicCache`` transformers builds: a w-token key/value ring buffer + the latent state),
the base model's the usual growing key/value cache. Reported per point: median and p90 step
latency, tokens/s, and the bytes the cache holds after the context. The two models' steps
are interleaved at each length (both caches prefilled first), so load drift on a shared machine
moves both alike and the speed-up is a same-moment ratio.

``--compile``: the converted model decodes through :class:`retrofit.decoding.CompiledDecoder`
(one compiled graph per step, weights frozen), and the base is timed twice: as it ships (the
``base`` rows) and given the same treatment (``base_compiled``: transformers' ``StaticCache``
sized to the context and ``torch.compile(fullgraph=True)`` of its forward, weights frozen).
Each compiled model takes one untimed step first (the compilation, recorded as ``compile_s``).
The converted graph serves every length; the base compiles one graph per length (its
StaticCache has the length's shape), each holding its own frozen copy of the weights.
"""
from __future__ import annotations

import argparse
import statistics
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from retrofit.bench.common import (
    finish_pair_bench,
    hardware_info,
    log_log_axes,
    markdown_table,
    save_figure_atomic,
    start_run,
    sync,
)
from retrofit.bench.models import build_pair, cache_bytes, forward_kwargs
from retrofit.layers.cache import cache_keyword, output_cache

__all__ = ["run_decode_benchmark", "decode_points"]

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (256, 512, 1024)


def _random_context(model, T: int, batch: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, int(model.config.vocab_size), (batch, T), generator=g).to(device)


@torch.no_grad()
def _timed_prefill(model, ids: torch.Tensor, cache: Any, prefill_chunk: int, device, *,
                   positions: bool = False) -> tuple[Any, Any, float]:
    """Feed ``ids`` [B, T] into ``cache`` ``prefill_chunk`` tokens at a time; returns the last output,
    the filled cache and the seconds it took. ``positions``: pass each chunk's ``cache_position``
    (a ``StaticCache`` needs them; a dynamic cache counts its own)."""
    keyword, kw = cache_keyword(model.forward), forward_kwargs(model)
    sync(device)
    t0 = time.perf_counter()
    out = None
    for i in range(0, ids.shape[1], prefill_chunk):
        chunk = ids[:, i : i + prefill_chunk]
        at = {"cache_position": torch.arange(i, i + chunk.shape[1], device=device)} if positions else {}
        out = model(input_ids=chunk, use_cache=True, **{keyword: cache}, **at, **kw)
        cache = output_cache(out)
    sync(device)
    return out, cache, time.perf_counter() - t0


class _Decoder:
    """One model's decoding run at one context: prefill, then timed single-token steps."""

    @torch.no_grad()
    def __init__(self, model, T: int, *, batch: int, prefill_chunk: int, device, seed: int = 0):
        from transformers import DynamicCache

        self.model, self.device = model, device
        self.keyword = cache_keyword(model.forward)
        ids = _random_context(model, T, batch, seed, device)
        out, self.cache, self.prefill_s = _timed_prefill(model, ids, DynamicCache(config=model.config), prefill_chunk,
                                                         device)
        self.context_bytes = cache_bytes(self.cache)
        self.nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        self.T, self.batch, self.steps = T, batch, []

    @torch.no_grad()
    def step(self) -> None:
        sync(self.device)
        t0 = time.perf_counter()
        out = self.model(input_ids=self.nxt, use_cache=True, **{self.keyword: self.cache})
        self.nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(self.device)
        self.steps.append(time.perf_counter() - t0)
        self.cache = output_cache(out)

    def result(self) -> dict[str, Any]:
        steps = self.steps
        warm = steps[1:] if len(steps) > 2 else steps  # the first step may pay one-time costs
        p90 = sorted(warm)[min(len(warm) - 1, int(0.9 * len(warm)))]
        med = statistics.median(warm)
        row = {
            "T": self.T, "prefill_s": self.prefill_s, "step_s": med, "step_p90_s": p90, "tokens_per_s": self.batch / med,
            "steps_s": steps, "cache_bytes": self.context_bytes, "cache_bytes_end": self.bytes_now(),
        }
        if getattr(self, "compile_s", None) is not None:
            row["compile_s"] = self.compile_s
        return row

    def bytes_now(self) -> int:
        return cache_bytes(self.cache)


# one compiled step per model for the whole run: the converted model's graph does not depend on the
# context, and each compiled graph holds its own frozen copy of the weights
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


class _CompiledConvertedDecoder(_Decoder):
    """The converted model through :class:`retrofit.decoding.CompiledDecoder`."""

    @torch.no_grad()
    def __init__(self, model, T: int, *, batch: int, prefill_chunk: int, device, seed: int = 0):
        from retrofit.decoding import CompiledDecoder

        self.model, self.device = model, device
        if model not in _COMPILED:
            _COMPILED[model] = CompiledDecoder(model, prefill_chunk=prefill_chunk)
        self.decoder = _COMPILED[model]
        ids = _random_context(model, T, batch, seed, device)
        sync(device)
        t0 = time.perf_counter()
        logits = self.decoder.prefill(ids)
        sync(device)
        self.prefill_s = time.perf_counter() - t0
        self.context_bytes = self.decoder.memory_bytes()
        self.nxt = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        self.nxt = self.decoder.step(self.nxt).argmax(-1, keepdim=True)  # compiles
        self.compile_s = time.perf_counter() - t0
        self.T, self.batch, self.steps = T, batch, []

    @torch.no_grad()
    def step(self) -> None:
        sync(self.device)
        t0 = time.perf_counter()
        self.nxt = self.decoder.step(self.nxt).argmax(-1, keepdim=True)
        sync(self.device)
        self.steps.append(time.perf_counter() - t0)

    def bytes_now(self) -> int:
        return self.decoder.memory_bytes()


class _CompiledBaseDecoder(_Decoder):
    """The base as transformers compiles it for decoding: a ``StaticCache`` sized to the context
    plus the steps, ``torch.compile(fullgraph=True)`` of the forward, weights frozen."""

    @torch.no_grad()
    def __init__(self, model, T: int, *, batch: int, prefill_chunk: int, device, seed: int = 0, steps: int = 1):
        from transformers import StaticCache

        self.model, self.device = model, device
        ids = _random_context(model, T, batch, seed, device)
        cache = StaticCache(config=model.config, max_cache_len=T + steps + 1)
        out, self.cache, self.prefill_s = _timed_prefill(model, ids, cache, prefill_chunk, device, positions=True)
        self.context_bytes = cache_bytes(self.cache)
        if model not in _COMPILED:
            _COMPILED[model] = torch.compile(model.forward, fullgraph=True, dynamic=False)
        self.forward = _COMPILED[model]
        self.position = T
        self.nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        self._advance()  # compiles
        self.compile_s = time.perf_counter() - t0
        self.T, self.batch, self.steps = T, batch, []

    def _advance(self) -> None:
        from torch._inductor import config as inductor_config

        with inductor_config.patch(freezing=True):
            out = self.forward(input_ids=self.nxt, past_key_values=self.cache, use_cache=True,
                               cache_position=torch.tensor([self.position], device=self.device))
        self.nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        self.position += 1

    @torch.no_grad()
    def step(self) -> None:
        sync(self.device)
        t0 = time.perf_counter()
        self._advance()
        sync(self.device)
        self.steps.append(time.perf_counter() - t0)


def decode_points(models: dict[str, Any], T: int, *, batch: int, new_tokens: int, prefill_chunk: int, device,
                  seed: int = 0, compile: bool = False) -> dict[str, dict[str, Any]]:
    """Prefill ``T`` tokens into each model's cache, then time ``new_tokens`` steps of each,
    the models' steps interleaved (base, converted, base, ...) so that machine-load drift hits
    both alike. Returns per model: latencies (median, p90, all steps) and cache bytes; a model that
    runs out of memory gets ``{"T", "error"}``. ``compile``: the converted model decodes compiled
    and the base runs twice, as it ships (``base``) and compiled (``base_compiled``)."""
    kinds = {name: _Decoder for name in models}
    if compile:
        kinds = {"base": _Decoder, "base_compiled": _CompiledBaseDecoder, "converted": _CompiledConvertedDecoder}
        models = {"base": models["base"], "base_compiled": models["base"], "converted": models["converted"]}
    runs, rows = {}, {}
    for name, model in models.items():
        extra = {"steps": new_tokens + 1} if kinds[name] is _CompiledBaseDecoder else {}
        try:
            runs[name] = kinds[name](model, T, batch=batch, prefill_chunk=prefill_chunk, device=device, seed=seed, **extra)
        except RuntimeError as exc:  # out of memory at long contexts: record and go on
            rows[name] = {"T": T, "error": str(exc).splitlines()[0][:200]}
    for _ in range(new_tokens):
        for name, run in list(runs.items()):
            try:
                run.step()
            except RuntimeError as exc:
                rows[name] = {"T": T, "error": str(exc).splitlines()[0][:200]}
                del runs[name]
    rows.update({name: run.result() for name, run in runs.items()})
    return {name: rows[name] for name in models}


def run_decode_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    device = start_run(args)
    lengths = sorted(args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS))
    new_tokens = min(args.new_tokens, 8) if args.quick else args.new_tokens
    base, converted, info = build_pair(args, max(lengths) + new_tokens + 1)
    if args.compile:  # refuse before any prefill, not at the first length
        from retrofit.decoding import compiled_decoding_support, compiler_missing
        from retrofit.errors import RetrofitError

        reason = compiled_decoding_support(converted) or compiler_missing(device)
        if reason is not None:
            raise RetrofitError(f"--compile: {reason}; run without --compile")
    hw = hardware_info(device)
    rows = []
    bar = tqdm(lengths, desc="bench decode", unit="length", disable=args.quiet)
    for T in bar:
        bar.set_postfix_str(f"T={T}")
        points = decode_points({"base": base, "converted": converted}, T, batch=args.batch, new_tokens=new_tokens,
                               prefill_chunk=args.prefill_chunk, device=device, seed=args.seed, compile=args.compile)
        rows += [{"model": name, **r} for name, r in points.items()]
    config = {"lengths": lengths, "new_tokens": new_tokens, "batch": args.batch, "prefill_chunk": args.prefill_chunk,
              "device": args.device, "dtype": args.dtype, "backend": args.backend, "steps": "interleaved",
              "compile": bool(args.compile)}
    return finish_pair_bench("decode", args, hw, info, config, rows, render_table, _plot)


def render_table(report: dict[str, Any]) -> str:
    by = {(r["model"], r["T"]): r for r in report["rows"]}
    compiled = bool(report["config"].get("compile"))
    ms = lambda r: r["step_s"] * 1e3 if "step_s" in r else None  # noqa: E731
    mib = lambda r: r["cache_bytes"] / 2**20 if "cache_bytes" in r else None  # noqa: E731
    ratio = lambda a, b: a["step_s"] / b["step_s"] if "step_s" in a and "step_s" in b else None  # noqa: E731
    rows = []
    for T in report["config"]["lengths"]:
        b, c, bc = by.get(("base", T), {}), by.get(("converted", T), {}), by.get(("base_compiled", T), {})
        if compiled:
            rows.append([T, ms(b), ms(bc), ms(c), ratio(b, c), ratio(bc, c), mib(b), mib(c)])
        else:
            rows.append([T, ms(b), ms(c), ratio(b, c), mib(b), mib(c)])
    if compiled:
        return markdown_table(["context", "base ms/token", "base compiled ms/token", "converted compiled ms/token",
                               "speedup vs base", "speedup vs compiled base", "base cache MiB", "converted cache MiB"], rows)
    return markdown_table(
        ["context", "base ms/token", "converted ms/token", "speedup", "base cache MiB", "converted cache MiB"], rows
    )


def _plot(report: dict[str, Any], path: Path) -> None:
    from retrofit.extras import require

    matplotlib = require("matplotlib", "plots (PNG files)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("base", "-o"), ("base_compiled", "--o"), ("converted", "-s")):
        rs = sorted((r for r in report["rows"] if r["model"] == name and "step_s" in r), key=lambda r: r["T"])
        if not rs:
            continue
        label = report["models"]["converted" if name == "converted" else "base"]
        label = label if len(label) < 60 else label[:57] + "..."
        ax_t.plot([r["T"] for r in rs], [r["step_s"] * 1e3 for r in rs], style, label=f"{name}: {label}", ms=4)
        ax_m.plot([r["T"] for r in rs], [r["cache_bytes"] / 2**20 for r in rs], style, label=name, ms=4)
    log_log_axes(((ax_t, "latency per token (ms)"), (ax_m, "cache after the context (MiB)")), "context length")
    if ax_t.get_legend_handles_labels()[0]:  # every point failed or timed out: no lines, no legend
        ax_t.legend(fontsize=7)
    fig.suptitle(f"decoding: {report['config']['dtype']} on {report['hardware'].get('gpu') or report['hardware']['cpu_model']}",
                 fontsize=9)
    save_figure_atomic(fig, path)
    plt.close(fig)
