"""Where the needle's block ranks for the last query of a passkey prompt, under block retrieval's two rankings.

A passkey prompt (4K, the key at depth 0 unless told; plain text) is prefilled through a Hedgehog
model with block retrieval on; the prompt's last token is then decoded alone, and for each layer and query head the
script records the rank (0 = first) of the block holding the key's first digit among the stored
blocks by Quest's bound (``retrieve_score bound``) and by the block's best score (``max``), and the
rank of the best digit token among all stored tokens. A block is read when its rank is below
``retrieve``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import retrofit.ops.exact_tier as exact_tier  # noqa: E402
from retrofit.eval import loading, prompting  # noqa: E402
from retrofit.eval.passkey import prompt_grid  # noqa: E402
from retrofit.fs.atomic import write_json_atomic  # noqa: E402
from retrofit.layers.cache import RetrofitCache, cache_keyword  # noqa: E402
from retrofit.layers.tier import set_tier  # noqa: E402
from tier_needle_probe import key_positions  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a converted Hedgehog folder (e.g. the output of retrofit fit)")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--depth", type=float, default=0.0, help="where the key sits (0 = the haystack's start, 1 = its end)")
    p.add_argument("--haystack", default="pg-books", help="the passkey filler: a corpus, or noise (the classic sentences)")
    p.add_argument("--retrieve", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = loading.load_model(args.model, device="cpu", dtype=None)
    model.eval()
    bos_id = tok.bos_token_id if loading.needs_bos(model, tok, "auto") else None
    frame = prompting.build_frame(tok, chat=prompting.use_chat_template(tok, "off"), bos_id=bos_id)
    prompt = prompt_grid(tok, [args.length], [args.depth], trials=1, frame=frame, bos_id=bos_id,
                         haystack=args.haystack)[0]
    digits = key_positions(tok, prompt["ids"], prompt["needle_at"], prompt["key"])
    set_tier(model, 0, block=args.block, retrieve=args.retrieve, retrieve_score="bound")
    rows: list[dict] = []
    recording = False
    original = exact_tier._retrieved_bound

    def probe(state, mq, retrieve, block):
        if recording:
            B, Hkv, NB = state.store_lo.shape[:3]
            group = mq.shape[1] // Hkv
            lo, hi = (exact_tier._rep(x, group).to(mq.dtype) for x in (state.store_lo, state.store_hi))
            q = mq[0, :, -1]  # (Hq, d): the last query
            bound = q.clamp_min(0)[:, None] @ hi[0].transpose(-1, -2) + q.clamp_max(0)[:, None] @ lo[0].transpose(-1, -2)
            bound = bound[:, 0]  # (Hq, NB)
            s = (q[:, None] @ exact_tier._rep(state.store_keys, group)[0].transpose(-1, -2))[:, 0]  # (Hq, N)
            s = s.masked_fill(~state.store_valid[0][None], float("-inf"))
            best = s.view(-1, NB, block).amax(-1)
            b0 = digits[0] // block
            rows.append({"layer": len(rows),
                         "rank_by_bound": (bound > bound[:, b0:b0 + 1]).sum(-1).tolist(),
                         "rank_by_max": (best > best[:, b0:b0 + 1]).sum(-1).tolist(),
                         "rank_of_best_digit_token": (s > s[:, digits].amax(-1, keepdim=True)).sum(-1).tolist()})
        return original(state, mq, retrieve, block)

    exact_tier._retrieved_bound = probe
    ids = torch.tensor([prompt["ids"]])
    cache = RetrofitCache(model)
    with torch.no_grad():
        model(ids[:, :-1], **{cache_keyword(model.forward): cache}, use_cache=True)
        recording = True
        model(ids[:, -1:], **{cache_keyword(model.forward): cache}, use_cache=True)
    pairs = [(r, h) for r in rows for h in range(len(r["rank_by_max"]))]
    summary = {by: sum(r[f"rank_by_{by}"][h] < args.retrieve for r, h in pairs) / len(pairs) for by in ("bound", "max")}
    print(f"needle block read (rank < {args.retrieve}) in {summary['bound']:.0%} of layer x head pairs by the bound, "
          f"{summary['max']:.0%} by the best score")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), {"model": args.model, "length": args.length, "depth": args.depth,
                                       "haystack": args.haystack,
                                       "block": args.block,
                                       "retrieve": args.retrieve, "key": prompt["key"], "digit_positions": digits,
                                       "needle_block_read": summary, "layers": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
