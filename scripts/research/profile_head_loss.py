"""Time an LM head's training loss (forward + backward) two ways, on random data of a head's shape.

    python scripts/research/profile_head_loss.py                      # Gemma 3 270M's head: V=262144, D=640
    python scripts/research/profile_head_loss.py --positions 4096 --train-weight

* ``tiled``: :func:`retrofit.ops.head_loss.linear_head_losses` (tiles of positions x vocabulary);
* ``slices``: what a head that is not a plain ``nn.Linear`` still takes (``sliced_head_terms``'
  fallback): the module on slices of ``logit_budget / V`` positions, log-softmax + NLL, each slice
  recomputed in backward.

Prints seconds and GFLOP/s per form (FLOPs: 2NVD forward, 4NVD backward with its recompute, +2NVD
for the weight's gradient). BENCHMARKS.md cites it for the sliced-head change.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from retrofit.ops.head_loss import linear_head_losses
from retrofit.surgery.lm_head import DEFAULT_LOGIT_BUDGET


def _slices(hidden, head, targets, step):
    def piece(h, y):  # h: (1, n, D), a slice of the (1, N, D) hidden states as the decoder returns them
        logp = torch.log_softmax(head(h).float(), dim=-1)
        return F.nll_loss(logp.reshape(-1, logp.shape[-1]), y, reduction="sum")

    total = None
    for s in range(0, hidden.shape[0], step):
        v = checkpoint(piece, hidden[None][:, s:s + step], targets[s:s + step], use_reentrant=False)
        total = v if total is None else total + v
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--dim", type=int, default=640)
    ap.add_argument("--train-weight", action="store_true", help="the head's weight takes a gradient too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    N, V, D = args.positions, args.vocab, args.dim
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) * 0.05)
    head.weight.requires_grad_(args.train_weight)
    hidden = torch.randn(N, D, generator=g).requires_grad_(True)
    targets = torch.randint(0, V, (N,), generator=g)
    step = max(1, DEFAULT_LOGIT_BUDGET // V)
    forms = {
        "tiled": lambda: linear_head_losses(hidden, head.weight, targets)[1],
        f"slices of {step}": lambda: _slices(hidden, head, targets, step),
    }
    flop_f, flop_b = 2 * N * V * D, (6 if args.train_weight else 4) * N * V * D
    print(f"N={N} V={V} D={D} threads={args.threads} weight grad={args.train_weight}")
    for name, fn in forms.items():
        best = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            loss = fn()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            hidden.grad = head.weight.grad = None
            best = (t1 - t0, t2 - t1) if best is None or t2 - t0 < sum(best) else best
        f, b = best
        print(f"{name:>16}: forward {f:6.2f} s ({flop_f / f / 1e9:4.0f} GFLOP/s)  backward {b:6.2f} s "
              f"({flop_b / b / 1e9:4.0f} GFLOP/s)  total {f + b:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
