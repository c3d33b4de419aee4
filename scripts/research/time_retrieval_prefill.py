"""Seconds to prefill one prompt of random tokens through a Hedgehog model's cache with block retrieval
or an exact tier on, in chunks (as ``retrofit eval passkey`` prefills), then to decode 8 tokens; and the
cache's bytes after the prefill and after decoding (the bounded tier's stay the same at every length).

    python scripts/research/time_retrieval_prefill.py runs/hh-fit --length 8192 --chunk 4096 --retrieve 8
    python scripts/research/time_retrieval_prefill.py runs/hh-fit --length 8192 --retrieve 0 --tier 256
"""
from __future__ import annotations

import argparse
import time

import torch

from retrofit.bench.models import cache_bytes
from retrofit.eval import loading
from retrofit.layers.cache import RetrofitCache, cache_keyword
from retrofit.layers.tier import set_tier


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a converted Hedgehog folder (e.g. the output of retrofit fit)")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--retrieve", type=int, default=8)
    p.add_argument("--tier", type=int, default=0, help="exact tier tokens per KV head (with --retrieve 0)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = loading.load_model(args.model, device="cpu", dtype=None)
    model.eval()
    set_tier(model, args.tier, retrieve=args.retrieve)
    ids = torch.randint(100, 20000, (1, args.length), generator=torch.Generator().manual_seed(0))
    cache = RetrofitCache(model)
    kw = {cache_keyword(model.forward): cache, "use_cache": True}
    with torch.no_grad():
        t0 = time.perf_counter()
        for start in range(0, args.length, args.chunk):
            model(ids[:, start:start + args.chunk], **kw)
        t1 = time.perf_counter()
        prefilled = cache_bytes(cache)
        for _ in range(8):
            model(ids[:, :1], **kw)
        t2 = time.perf_counter()
    print(f"length {args.length} in chunks of {args.chunk} (tier {args.tier}, retrieve {args.retrieve}): prefill "
          f"{t1 - t0:.1f} s, 8 decoding steps {t2 - t1:.2f} s; cache {prefilled / 2**20:.2f} MiB after the prefill, "
          f"{cache_bytes(cache) / 2**20:.2f} MiB after decoding")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
