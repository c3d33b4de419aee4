"""Where one chunk of a long-context perplexity forward spends its time, by module kind (measured
2026-11-24; scripts/research/README.md).

The model runs ``--past`` tokens of a book through its cache in ``--chunk``-token chunks, as
``retrofit eval ppl --chunk-size`` does; the next chunk is then timed per attention kind (one row
per attention class and ``config.layer_types`` entry), MLPs, and the LM head + cross-entropy.

    python scripts/research/profile_eval_chunk.py gemma3-270m --past 28672 --attention stock
    python scripts/research/profile_eval_chunk.py gemma3-270m --past 28672 --attention scoring
    python scripts/research/profile_eval_chunk.py runs/demo/train/final --past 28672
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import time
from pathlib import Path

import torch

from retrofit.data.paths import bundled_data_dir
from retrofit.eval import loading, nll
from retrofit.layers.cache import cache_keyword, output_cache

BOOKS = bundled_data_dir() / "pg-books"


def _timed(module: torch.nn.Module, key: str, acc: dict[str, float]) -> None:
    start: list[float] = []
    module.register_forward_pre_hook(lambda *_: start.append(time.perf_counter()))
    module.register_forward_hook(lambda *_: acc.__setitem__(key, acc[key] + time.perf_counter() - start.pop()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="anything retrofit.surgery.load_any accepts (gemma3-270m, a run's final/)")
    p.add_argument("--book", default=None, help="a .txt file (default: the bundled jack-sheppard.txt)")
    p.add_argument("--past", type=int, default=28672, help="tokens already in the cache")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--attention", choices=("stock", "scoring"), default="scoring",
                   help="an unconverted model under its own attention, or as `retrofit eval` scores it")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tok = loading.load_model(args.model)
    book = Path(args.book) if args.book else BOOKS / "jack-sheppard.txt"
    n = args.past + args.chunk
    ids = tok(book.read_text()[: n * 8], return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise SystemExit(f"error: {book} has fewer than {n} tokens; lower --past")

    acc: dict[str, float] = collections.defaultdict(float)
    kinds = getattr(model.config, "layer_types", None) or ["attention"] * len(model.model.layers)
    for layer, kind in zip(model.model.layers, kinds):
        _timed(layer.self_attn, f"{type(layer.self_attn).__name__} ({kind})", acc)
        _timed(layer.mlp, "MLP", acc)
    scoring = loading.scoring_attention(model) if args.attention == "scoring" else contextlib.nullcontext("stock")
    with torch.no_grad(), scoring as impl:
        cache, kw = None, cache_keyword(model.model.forward)
        for s in range(0, args.past, args.chunk):
            cache = output_cache(model.model(input_ids=ids[:, s : s + args.chunk], use_cache=True, **{kw: cache}))
        acc.clear()
        t0 = time.perf_counter()
        hidden = model.model(input_ids=ids[:, args.past : n], use_cache=True, **{kw: cache}).last_hidden_state
        t1 = time.perf_counter()
        slice_tokens = nll.slice_tokens_for(model.get_output_embeddings().weight.shape[0])
        nll.sliced_token_nll(model, hidden[:, :-1], ids[:, args.past + 1 : n], slice_tokens=slice_tokens)
        t2 = time.perf_counter()
    print(f"{args.model}: chunk of {args.chunk} tokens after {args.past}, attention {impl}, {args.threads} threads")
    for key, seconds in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {key:<40} {seconds:6.1f} s")
    print(f"  {'decoder total':<40} {t1 - t0:6.1f} s")
    print(f"  {'LM head + cross-entropy':<40} {t2 - t1:6.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
