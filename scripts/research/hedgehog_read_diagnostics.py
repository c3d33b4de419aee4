"""Two diagnostics of a fitted `method: hedgehog` read, on the base's own layer inputs.

``distance``: how much of the read's KL beyond the window is a distance profile. Per layer, KL(the
base's weights over the read's keys || the read's kernel weights times ``distance^-alpha``,
renormalised) for a grid of alpha; alpha = 0 is the read as it is. A position-free read cannot
see distance; if a prior on it lowered the KL much, a decaying state would be worth building.

``shrink``: the share's logit shift per layer and head (added to ``memory_scale.bias``) that
minimises the layer's attention-output error against the base's full softmax output, per head
before o_proj: ``|| (1 - p) SWA + p read - softmax(all keys) V ||^2`` with ``p = sigmoid(logit + delta)``,
delta on a grid. A least-squares scale makes ``p`` the base's share beyond the window; where the
read's output is off, a smaller share errs less (the read's error enters times ``p``). Writes the
shifted model as a delta checkpoint (``--out``).

    python scripts/research/hedgehog_read_diagnostics.py distance runs/smollm2-135m-hedgehog-fit-cpu/final --layers 3 13 18 27
    python scripts/research/hedgehog_read_diagnostics.py shrink runs/smollm2-135m-hedgehog-fit-cpu/final --out runs/exp/shrink
"""
from __future__ import annotations

import argparse
import time

import torch

from retrofit.surgery import save_delta
from retrofit.surgery.distill import converted_modules
from retrofit.surgery.loading import load_any
from retrofit.train.fit import capture_layer_inputs, fit_sequences
from retrofit.train.recipe import load_recipe

RECIPE = "configs/smollm2-135m-hedgehog-fit-cpu.yaml"


def _terms(attn, h, pe, rows):
    with torch.no_grad():
        return attn._weight_terms(h, pe, None, rows, attn.patch.project_qkv(attn, h, pe))


def distance(model, captured, layers, alphas) -> None:
    by_idx = {int(m.layer_idx): m for m in converted_modules(model)}
    for li in layers:
        attn, kls = by_idx[li], {a: [] for a in alphas}
        for cap in captured:
            h, pe = cap[li]
            T = h.shape[1]
            rows = torch.linspace(attn.window + attn.sinks, T - 1, 96).round().long().unique()
            t = _terms(attn, h, pe, rows)
            keys = t.memory & t.seen
            s = t.s.masked_fill(~keys, float("-inf"))
            teacher = torch.where(keys, s - s.logsumexp(-1, keepdim=True), 0.0)
            log_dist = (rows[:, None] - torch.arange(T)[None, :]).clamp_min(1).float().log()
            for a in alphas:
                lk = (t.kappa.clamp_min(1e-30).log() - a * log_dist).masked_fill(~keys, float("-inf"))
                student = torch.where(keys, lk - lk.logsumexp(-1, keepdim=True), 0.0)
                kl = torch.where(keys, teacher.exp() * (teacher - student), 0.0).sum(-1)
                kls[a].append(kl[keys.any(-1).expand_as(kl)].mean())
        print(f"layer {li}: " + ", ".join(f"alpha {a}: KL {float(torch.stack(v).mean()):.3f}" for a, v in kls.items()),
              flush=True)


def shrink(model, captured, deltas, rows_per_seq) -> None:
    for attn in converted_modules(model):
        li = int(attn.layer_idx)
        err = torch.zeros(attn.num_heads, len(deltas), dtype=torch.float64)
        g = torch.Generator().manual_seed(li)
        for cap in captured:
            h, pe = cap[li]
            rows = torch.randint(attn.window + attn.sinks, h.shape[1], (rows_per_seq,), generator=g).unique()
            t = _terms(attn, h, pe, rows)
            v = t.values.float()
            target = t.s.masked_fill(~t.seen, float("-inf")).softmax(-1) @ v  # (B, H, R, D): the base's output
            window = t.s_window.masked_fill(~t.window, float("-inf")).softmax(-1) @ v
            mass = t.kappa.sum(-1)
            has = mass > 0
            read = (t.kappa @ v) / torch.where(has, mass, 1.0)[..., None]
            logit = mass.clamp_min(1e-30).log() + t.scale - t.lse
            ok = (has & t.real_rows[:, None]).float()
            for k, d in enumerate(deltas):
                p = torch.where(has, torch.sigmoid(logit + d), 0.0)[..., None]
                err[:, k] += ((((window + p * (read - window)) - target) ** 2).sum(-1) * ok).sum((0, 2)).double()
        best = deltas[err.argmin(-1)]
        kept = err[:, int(deltas.abs().argmin())]
        with torch.no_grad():
            attn.memory_scale.bias.add_(best.to(attn.memory_scale.bias.dtype))
        print(f"layer {li}: shifts {[round(float(x), 1) for x in best]}, output error "
              f"-{100 * float((1 - err.min(-1).values / kept).mean()):.1f}% (mean over heads)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["distance", "shrink"])
    p.add_argument("model", help="a hedgehog conversion (folder or delta)")
    p.add_argument("--recipe", default=RECIPE, help="its data section gives the sequences")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--recall-share", type=float, default=0.0, help="data.recall.share (0: the books as they are)")
    p.add_argument("--seed", type=int, default=7, help="data.seed (the fit's own sequences are seed 0)")
    p.add_argument("--layers", type=int, nargs="+", default=[3, 13, 18, 27], help="distance: the layers")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0, 1.5])
    p.add_argument("--rows", type=int, default=256, help="shrink: query rows per sequence")
    p.add_argument("--out", help="shrink: where the shifted model is written")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    model, tok = load_any(args.model, dtype=torch.float32)
    recipe = load_recipe(args.recipe, [f"data.recall.share={args.recall_share}", f"data.seed={args.seed}"])
    captured = [capture_layer_inputs(model, ids) for ids in fit_sequences(recipe, tok, args.seq_len, args.sequences, None)]
    print(f"captured {args.sequences} x {args.seq_len} tokens ({time.time() - start:.0f} s)", flush=True)
    if args.what == "distance":
        distance(model, captured, args.layers, args.alphas)
    else:
        if not args.out:
            p.error("shrink needs --out")
        shrink(model, captured, torch.arange(-40, 21) / 10.0, args.rows)
        save_delta(model, args.out, overwrite=True)
        print(f"wrote {args.out}", flush=True)
    print(f"done in {(time.time() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
