"""Count the aten calls of one decoding step, base vs hybrid conversion: the per-token overhead
of the converted layers, independent of machine load (measured 2026-11-23; scripts/research/README.md).

A small random Gemma-3-shaped model (6 layers, 5 sliding + 1 global, as Gemma 3's 5:1 pattern)
is converted like the demo (global layers -> Macchiato with sinks), prefilled with ``--context``
tokens, stepped a few tokens, then one step is profiled with torch.profiler.

    python scripts/research/profile_decode.py --context 1024 --window 256 --latents 32 --sinks 4
"""
from __future__ import annotations

import argparse
import collections
import copy

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import retrofit  # noqa: F401 - registers the converted classes
from retrofit.layers.cache import RetrofitCache, cache_keyword
from retrofit.surgery import ConversionSpec, convert


def step_counts(model: torch.nn.Module, cache, ids: torch.Tensor) -> collections.Counter:
    kw = cache_keyword(model.forward)
    with torch.no_grad():
        out = model(ids, use_cache=True, **{kw: cache})
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            model(nxt, use_cache=True, **{kw: cache})
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(nxt, use_cache=True, **{kw: cache})
    return collections.Counter({e.key: e.count for e in prof.key_averages()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--latents", type=int, default=32)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--top", type=int, default=15, help="list the ops whose counts differ most")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, sliding_window=64, max_position_embeddings=4 * a.context,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])
    torch.manual_seed(0)
    base = transformers.Gemma3ForCausalLM(cfg).eval()
    spec = ConversionSpec(method="macchiato", layers="global", window=a.window, latents=a.latents, sinks=a.sinks)
    hybrid = convert(copy.deepcopy(base), spec)
    ids = torch.randint(3, cfg.vocab_size, (1, a.context))
    counts = {"base": step_counts(base, transformers.DynamicCache(config=cfg), ids),
              "hybrid": step_counts(hybrid, RetrofitCache(hybrid), ids)}
    aten = {k: sum(n for op, n in c.items() if op.startswith("aten::")) for k, c in counts.items()}
    print(f"aten calls per decoding step at {a.context} tokens of context: base {aten['base']}, "
          f"hybrid {aten['hybrid']} ({aten['hybrid'] - aten['base']:+d} for its 1 converted layer)")
    b, h = counts["base"], counts["hybrid"]
    diff = sorted(((h[k] - b[k], k) for k in set(b) | set(h) if k.startswith("aten::") and h[k] != b[k]), reverse=True)
    for d, k in diff[: a.top]:
        print(f"  {d:+5d}  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
