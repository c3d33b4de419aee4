"""Passkey accuracy with block retrieval in a subset of a Hedgehog model's layers (the rest keep only
their window, sinks and linear read): how much of the store retrieval needs.

Each subset is a comma list of decoder-layer indices or ranges
(``0-14``, ``15-29``, ``0,3,6``); the store's bytes scale with the number of layers in it.

    python scripts/research/retrieval_layers_passkey.py runs/hh-fit --subsets 0-14 15-29 --length 4096 \\
        --trials 5 --out runs/retrieval-layers.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from retrofit.eval import loading
from retrofit.eval.passkey import run_passkey
from retrofit.fs.atomic import write_json_atomic
from retrofit.layers.tier import set_tier, tier_layers


def parse_subset(spec: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a converted Hedgehog folder (e.g. the output of retrofit fit)")
    p.add_argument("--subsets", nargs="+", required=True)
    p.add_argument("--retrieve", type=int, default=8)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--depths", type=float, nargs="+", default=[0.0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = loading.load_model(args.model, device="cpu", dtype=None)
    model.eval()
    total = len(tier_layers(model))
    rows = []
    for spec in args.subsets:
        layers = parse_subset(spec)
        set_tier(model, 0, retrieve=args.retrieve, layers=layers)
        t0 = time.perf_counter()
        res = run_passkey(model, tokenizer=tok, lengths=[args.length], depths=args.depths, trials=args.trials,
                          chat_template="off", progress=False)
        acc = res["results"]["model"]["mean_accuracy"]
        rows.append({"layers": spec, "layers_with_retrieval": len(layers), "of": total, "accuracy": acc,
                     "answers": [t.get("answer") for t in res["results"]["model"]["trials"]],
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"retrieval in layers {spec} ({len(layers)}/{total}): passkey {acc:.0%} at {args.length} "
              f"({rows[-1]['seconds']} s)", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(args.out), {"model": args.model, "length": args.length, "depths": args.depths,
                                           "trials": args.trials, "retrieve": args.retrieve, "chat_template": "off",
                                           "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
