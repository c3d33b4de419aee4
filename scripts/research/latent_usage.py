"""How much a Macchiato conversion leans on its latent path, layer by layer, on held-out text.

For each converted layer, on the first ``--tokens`` tokens of a held-out file (the layers fed the
base model's own hidden states, as attention transfer trains them):

* ``share``: the mean sliding-window weight p(0|t) over tokens and query heads (1 = latent path unused);
* ``open``: the relative squared error of the layer's output against the frozen full attention's
  (``retrofit.layers.base``'s transfer loss), latent path as trained;
* ``closed``: the same with the latent path closed (window + sinks alone);
* ``gain``: ``1 - open / closed``, the share of the window's error the latent path removes.

    python scripts/research/latent_usage.py runs/smol-w1024-at/final \
        --text retrofit/data/pg-books/jack-sheppard.txt --tokens 4096 --out runs/latent_usage.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from retrofit.data.text import read_text
from retrofit.eval.loading import load_model
from retrofit.fs.atomic import write_json_atomic
from retrofit.surgery.distill import converted_modules, distill_mode, transfer_losses


def _record_shares(modules: list) -> tuple[dict[int, list[float]], list]:
    """Wrap each layer's ``mixing_logits`` to record mean p(0|t); returns the record and the handles to undo."""
    shares: dict[int, list[float]] = {}
    undo = []
    for m in modules:
        original = m.mixing_logits

        def wrapped(x, valid, tail, _m=m, _orig=original):
            mix, lat, new_tail = _orig(x, valid, tail)
            shares.setdefault(int(_m.layer_idx), []).append(float(mix.float().softmax(-1)[..., 0].mean()))
            return mix, lat, new_tail

        m.mixing_logits = wrapped
        undo.append((m, original))
    return shares, undo


@torch.no_grad()
def latent_usage(model, input_ids: torch.Tensor) -> list[dict]:
    """One row per converted layer: ``layer``, ``share``, ``open``, ``closed``, ``gain``."""
    modules = converted_modules(model)
    shares, undo = _record_shares(modules)
    try:
        with distill_mode(model, "transfer"):
            model(input_ids=input_ids, logits_to_keep=1)
            open_losses = [float(x) for x in transfer_losses(model)]
        for m in modules:
            m.latent_path_closed = True
        with distill_mode(model, "transfer"):
            model(input_ids=input_ids, logits_to_keep=1)
            closed_losses = [float(x) for x in transfer_losses(model)]
    finally:
        for m in modules:
            m.latent_path_closed = False
        for m, original in undo:
            m.mixing_logits = original
    rows = []
    for m, o, c in zip(modules, open_losses, closed_losses):
        i = int(m.layer_idx)
        rows.append({"layer": i, "share": shares[i][0], "open": o, "closed": c,
                     "gain": 1.0 - o / c if c > 0 else 0.0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a converted Macchiato checkpoint folder")
    ap.add_argument("--text", required=True, help="held-out text file")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model, dtype="float32")
    model.eval()
    ids = tokenizer(read_text(args.text), return_tensors="pt").input_ids[:, : args.tokens]
    rows = latent_usage(model, ids)
    print(f"{'layer':>5} {'p(0|t)':>7} {'err open':>9} {'err closed':>10} {'gain':>7}")
    for r in rows:
        print(f"{r['layer']:>5} {r['share']:>7.3f} {r['open']:>9.4f} {r['closed']:>10.4f} {r['gain']:>7.1%}")
    tot_o, tot_c = sum(r["open"] for r in rows), sum(r["closed"] for r in rows)
    print(f"  sum         {tot_o:>9.4f} {tot_c:>10.4f} {1 - tot_o / tot_c:>7.1%}")
    if args.out:
        write_json_atomic(args.out, {"model": args.model, "text": args.text, "tokens": int(ids.shape[1]), "layers": rows},
                          indent=1)


if __name__ == "__main__":
    main()
