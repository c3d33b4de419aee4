"""Time one decoding step three ways, interleaved: the base, the hybrid through its in-place
window slots, and the hybrid through the general (concatenating) path (measured 2026-11-23; scripts/research/README.md).

A random Gemma-3-270M-shaped model with 6 layers (5 sliding + 1 global; hidden 640, 4 query heads,
1 KV head, head_dim 256) is converted like the demo (the global layer -> Macchiato, w = 2048,
L = 128, 4 sinks), each variant is prefilled with ``--context`` tokens, and the steps of the three
alternate so load drift hits all alike. Prints median and min step time in ms.

    python scripts/research/time_decode_paths.py --context 1024 4096
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers

import retrofit  # noqa: F401 - registers the converted classes
from retrofit.layers.cache import RetrofitCache, cache_keyword
from retrofit.surgery import ConversionSpec, convert


def _set_slots(model: torch.nn.Module, on: bool) -> None:
    for m in model.modules():
        if hasattr(m, "slot_decoding"):
            m.slot_decoding = on


@torch.no_grad()
def _prefill(model, cache, ids):
    kw = cache_keyword(model.forward)
    out = model(ids, use_cache=True, **{kw: cache})
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(3):
        model(nxt, use_cache=True, **{kw: cache})
    return nxt, cache


@torch.no_grad()
def time_paths(context: int, steps: int) -> dict[str, list[float]]:
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=640, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=4 * context,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])
    torch.manual_seed(0)
    base = transformers.Gemma3ForCausalLM(cfg).eval()
    hybrid = convert(copy.deepcopy(base), ConversionSpec(method="macchiato", layers="global", window=2048,
                                                         latents=128, sinks=4))
    ids = torch.randint(3, cfg.vocab_size, (1, context))
    _set_slots(hybrid, True)
    runs = {"base": (base, None, _prefill(base, transformers.DynamicCache(config=cfg), ids)),
            "slots": (hybrid, True, _prefill(hybrid, RetrofitCache(hybrid), ids))}
    _set_slots(hybrid, False)
    runs["general"] = (hybrid, False, _prefill(hybrid, RetrofitCache(hybrid), ids))
    times = {name: [] for name in runs}
    for _ in range(steps):
        for name, (model, slots, (nxt, cache)) in runs.items():
            if slots is not None:
                _set_slots(model, slots)
            t0 = time.perf_counter()
            model(nxt, use_cache=True, **{cache_keyword(model.forward): cache})
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print("| context | base ms | hybrid, slots ms | hybrid, general path ms | (min: base / slots / general) |")
    print("|---:|---:|---:|---:|---|")
    for c in a.context:
        t = time_paths(c, a.steps)
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        low = {k: min(v) * 1e3 for k, v in t.items()}
        print(f"| {c} | {med['base']:.2f} | {med['slots']:.2f} | {med['general']:.2f} | "
              f"{low['base']:.2f} / {low['slots']:.2f} / {low['general']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
