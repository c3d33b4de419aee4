"""Attention transfer aimed at retrieval: the per-layer transfer loss weighted up where a recall
answer is read, on sequences dense with facts placed beyond the window.

Uniform attention transfer spends its gradient on every position alike, and on books the few
positions where the full attention reads something beyond the window are a sliver of it. Here
every training sequence gets ``--facts`` recall facts (``retrofit.data.recall``) asked about at
least ``--min-distance`` tokens later, and the positions that predict an answer's value tokens
weigh ``--answer-weight`` times the others in every layer's relative error. Each layer is fed the
base's own hidden states (teacher forcing), so no gradient crosses layers. Progress is the
teacher-forced recall probe (``recall_probe.py``) on a held-out book, run every ``--probe-every``
steps, with the latent path open and closed.

``--objective answers`` trains end to end instead: the cross-entropy of the answers' value tokens
alone, through the converted model as it runs (no teacher), the direct form of what the probe
measures, at about twice the cost of a transfer step. The trained weights are written as a delta
(``OUT/delta``) that ``retrofit eval`` loads.

    cd scripts/research
    python recall_transfer.py ../../runs/gpu-kl/smollm2-delta --out ../../runs/recall/aw50 \
        --books ../../retrofit/data/pg-books --heldout ../../retrofit/data/pg-books/jack-sheppard.txt \
        --answer-weight 50 --max-minutes 55 --probe-every 40
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from retrofit.data.packing import make_tokenize
from retrofit.data.recall import RecallConfig, RecallInserter
from retrofit.data.text import read_text
from retrofit.eval.loading import load_model
from retrofit.fs.atomic import write_json_atomic
from retrofit.surgery.checkpoint import save_delta
from retrofit.surgery.distill import converted_modules, distill_mode

from recall_probe import probe_sequences, score  # noqa: E402  (same folder)

BOOKS = ("pride-and-prejudice", "moby-dick", "news-from-nowhere", "devils-dictionary")


def probe(model, tokenizer, seqs) -> dict:
    modules = converted_modules(model)
    out = {"open": score(model, tokenizer, seqs)}
    for m in modules:
        m.latent_path_closed = True
    try:
        out["closed"] = score(model, tokenizer, seqs)
    finally:
        for m in modules:
            m.latent_path_closed = False
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a converted Macchiato folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--books", default="retrofit/data/pg-books")
    ap.add_argument("--heldout", default="retrofit/data/pg-books/jack-sheppard.txt")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--facts", type=int, default=8)
    ap.add_argument("--min-distance", type=int, default=1100)
    ap.add_argument("--objective", choices=("transfer", "answers"), default="transfer",
                    help="transfer: weighted attention transfer; answers: end-to-end cross-entropy of the answers only")
    ap.add_argument("--answer-weight", type=float, default=50.0)
    ap.add_argument("--layers", default=None, help="train only these layers' latent weights, e.g. 10-29")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-minutes", type=float, default=60.0)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--probe-every", type=int, default=25)
    ap.add_argument("--probe-sequences", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model, dtype="float32")
    modules = converted_modules(model)
    keep = None
    if args.layers:
        lo, hi = (int(x) for x in args.layers.split("-"))
        keep = set(range(lo, hi + 1))
    params = []
    for p in model.parameters():
        p.requires_grad_(False)
    for m in modules:
        if keep is not None and int(m.layer_idx) not in keep:
            continue
        for name in m.new_parameter_names():
            p = m.get_parameter(name)
            p.requires_grad_(True)
            params.append(p)
    print(f"training {sum(p.numel() for p in params):,} weights in {len(modules) if keep is None else len(keep)} layers",
          flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    text = "\n\n".join(read_text(f"{args.books}/{b}.txt") for b in BOOKS)
    ids = np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)
    inserter = RecallInserter(RecallConfig(share=1.0, facts=args.facts, min_distance=args.min_distance, seed=args.seed,
                                           answer_weight=args.answer_weight), make_tokenize(tokenizer, special_tokens=False))
    n_blocks = len(ids) // args.length
    order = np.random.default_rng(args.seed).permutation(n_blocks)
    heldout = probe_sequences(tokenizer, read_text(args.heldout), sequences=args.probe_sequences, length=args.length,
                              facts=4, min_distance=args.min_distance, seed=1234)

    log = []
    model.eval()
    with torch.no_grad():
        log.append({"step": 0, "minutes": 0.0, **probe(model, tokenizer, heldout)})
    print(json.dumps(log[-1]), flush=True)
    start, step = time.time(), 0
    while step < args.max_steps and (time.time() - start) / 60 < args.max_minutes:
        b = int(order[step % n_blocks])
        block = ids[b * args.length:(b + 1) * args.length]
        plan = inserter.plan(args.length, b)
        x = torch.from_numpy(inserter(block, b))[None]
        weights = torch.from_numpy(inserter.position_weights(args.length, b))[None]
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():
            if args.objective == "answers":  # end to end: cross-entropy of the answers' value tokens only
                pos = torch.tensor([f.answer_value - 1 + j for f in plan or [] for j in range(len(f.value_ids))])
                tgt = torch.tensor([t for f in plan or [] for t in f.value_ids])
                hidden = model.model(input_ids=x).last_hidden_state[0, pos]
                loss = torch.nn.functional.cross_entropy(model.lm_head(hidden).float(), tgt)
            else:
                with distill_mode(model, "transfer", position_weights=weights) as mods:
                    model(input_ids=x, logits_to_keep=1)
                    loss = torch.stack([m.transfer_loss for m in mods if m.transfer_loss is not None]).sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        print(f"step {step} loss {float(loss.detach()):.4f} {(time.time() - start) / 60:.1f} min", flush=True)
        if step % args.probe_every == 0:
            with torch.no_grad():
                log.append({"step": step, "minutes": (time.time() - start) / 60, "loss": float(loss.detach()),
                            **probe(model, tokenizer, heldout)})
            print(json.dumps(log[-1]), flush=True)
            write_json_atomic(args.out / "log.json", {"args": vars(args) | {"out": str(args.out)}, "log": log}, indent=1)
    if step % args.probe_every:
        with torch.no_grad():
            log.append({"step": step, "minutes": (time.time() - start) / 60, **probe(model, tokenizer, heldout)})
        print(json.dumps(log[-1]), flush=True)
    write_json_atomic(args.out / "log.json", {"args": vars(args) | {"out": str(args.out)}, "log": log}, indent=1)
    save_delta(model, args.out / "delta", overwrite=True)  # retrofit.load-able, bound to the base by fingerprint


if __name__ == "__main__":
    main()
