"""Where a passkey's tokens end up under each exact-tier rule: after the prompt's prefill, which
(layer, KV head) tiers hold the needle's key digits, and how each rule ranks them.

For every prompt of ``retrofit eval passkey``'s grid (the same keys and filler) and every rule, the
converted Hedgehog model is prefilled with the tier set (``retrofit.layers.tier.set_tier``) and the
cache's tier indices are compared with the positions of the key's digit tokens. Reported per rule
and length: the share of (layer, KV head) pairs whose tier holds at least one key digit, the share
holding every key digit, and the same for a random choice of ``capacity`` tokens among the settled
ones (what a rule must beat).

    python scripts/research/tier_needle_probe.py runs/hh-fit --capacity 256 --lengths 4096 --trials 3 \
        --out runs/tier-probe.json
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from retrofit.eval import loading, prompting
from retrofit.fs.atomic import write_json_atomic
from retrofit.eval.passkey import NEEDLE, prompt_grid
from retrofit.layers.cache import RetrofitCache, cache_keyword
from retrofit.layers.tier import TIER_RULES, set_tier


def key_positions(tok, ids: list[int], needle_at: int, key: str) -> list[int]:
    """Stream positions of the tokens of the needle that spell the key's digits."""
    needle = tok(NEEDLE.format(key=key), add_special_tokens=False).input_ids
    out = []
    for i, t in enumerate(needle):
        if any(ch.isdigit() for ch in tok.decode([t])):
            out.append(needle_at + i)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a converted Hedgehog folder (e.g. the output of retrofit fit)")
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--rules", nargs="+", default=list(TIER_RULES))
    p.add_argument("--lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--depth", type=float, default=0.0, help="where the key sits (0 = the haystack's start, 1 = its end)")
    p.add_argument("--haystack", default="pg-books", help="the passkey filler: a corpus, or noise (the classic sentences)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = loading.load_model(args.model, device="cpu", dtype=None)
    model.eval()
    bos_id = tok.bos_token_id if loading.needs_bos(model, tok, "auto") else None  # as retrofit eval passkey --chat-template off
    frame = prompting.build_frame(tok, chat=prompting.use_chat_template(tok, "off"), bos_id=bos_id)
    prompts = prompt_grid(tok, args.lengths, [args.depth], trials=args.trials, frame=frame, bos_id=bos_id,
                          haystack=args.haystack)
    rows = []
    for rule in args.rules:
        set_tier(model, args.capacity, rule, args.block)
        for pr in prompts:
            t0 = time.perf_counter()
            ids = torch.tensor([pr["ids"]])
            cache = RetrofitCache(model)
            with torch.no_grad():
                model(ids, **{cache_keyword(model.forward): cache}, use_cache=True)
            digits = set(key_positions(tok, pr["ids"], pr["needle_at"], pr["key"]))
            any_held = all_held = rand_any = rand_all = pairs = 0
            rng = random.Random(0)
            for layer in cache.layers:
                tier = getattr(layer, "tier", None)
                if tier is None:
                    continue
                settled = tier.frontier
                for g in range(tier.tier_index.shape[1]):
                    held = set(int(i) for i in tier.tier_index[0, g] if i >= 0)
                    pick = set(rng.sample(range(settled), min(args.capacity, settled)))
                    pairs += 1
                    any_held += bool(held & digits)
                    all_held += digits <= held
                    rand_any += bool(pick & digits)
                    rand_all += digits <= pick
            rows.append({"rule": rule, "length": pr["length"], "trial": pr["trial"], "key": pr["key"],
                         "digit_tokens": len(digits), "pairs": pairs, "any": any_held / pairs, "all": all_held / pairs,
                         "random_any": rand_any / pairs, "random_all": rand_all / pairs,
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), {"capacity": args.capacity, "block": args.block, "model": args.model,
                                       "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
