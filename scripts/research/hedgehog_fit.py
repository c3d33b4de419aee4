"""Learned feature maps for a linear-time read: fit Hedgehog maps to the base's attention weights.

``oracle_memory.py`` finds that, with only the needle stored, no product-of-features kernel of
the pretrained keys and queries (Based's Taylor, relu or exp features) reads the passkey's digit,
while sharp kernels that no state can hold (softmax, relu of the score) do. Hedgehog (Zhang et
al., 2024; LoLCATs' first stage) learns feature maps that are spiky like the softmax:

    phi(x) = [softmax(W x), softmax(-W x)]    (2 f features, W (f, d) per head, one map for
                                               queries and one for keys)

fitted so that ``phi(q_t) . phi(k_j) / sum_j' phi(q_t) . phi(k_j')`` matches the softmax weights
over ``j <= t``. This script fits one pair per head of every layer on the base's own queries and
keys (post-RoPE, its own hidden states) over book text, and writes them to a safetensors file
that ``oracle_memory.py --feature-maps`` reads (rungs ``*-hedgehog``, ``*-hh*``). Fitted beyond a
window (``--beyond``), each layer also gets ``log_scale`` (per head, linear in the query): the
offset from the read's own mass to the softmax's unnormalised mass beyond the window, which gives
the ``all-hedgehog-lse`` rung a share a layer could compute.

    python scripts/research/hedgehog_fit.py --books retrofit/data/pg-books --out runs/oracle/hedgehog.safetensors

With ``--maps`` an earlier fit's maps are kept and only the scale is fitted, e.g. on sequences past
the base's context against the base with its RoPE distances capped (``--rope-cap``: its hidden
states and its scores, pairs farther apart scored at the cap), which is where the read's key count
grows past anything a fit inside the context sees.

``retrofit fit`` (retrofit/train/fit.py) is the toolkit's form of the position-free fit with the
key count: the same two parts, on the layer's own read (its maps, scale and masks), from a recipe.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from retrofit.data.packing import make_tokenize
from retrofit.data.recall import RecallConfig, RecallInserter
from retrofit.data.text import read_text
from retrofit.fs.atomic import write_bytes_atomic
from retrofit.ops import repeat_kv_heads, rope_rotate
from retrofit.ops.rope import rope_to_origin
from retrofit.patches import get_patch
from retrofit.surgery import cap_rope
from retrofit.surgery.loading import load_any

BOOKS = ("pride-and-prejudice", "moby-dick", "news-from-nowhere", "devils-dictionary")


def hedgehog(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, 2 f)`` features of ``x (B, H, T, d)`` through ``weight (H, f, d)``."""
    z = torch.einsum("bhtd,hfd->bhtf", x, weight)
    return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1)


@torch.no_grad()
def capture_qk(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the base's post-RoPE ``q (B, Hq, T, d)`` and ``k (B, Hq, T, d)`` (k repeated over its group)."""
    out, hooks, patch = [], [], get_patch(model)
    for layer in model.model.layers:
        attn = layer.self_attn

        def grab(module, args, kwargs, attn=attn):
            h = kwargs.get("hidden_states", args[0] if args else None)
            q, k, _ = patch.project_qkv(attn, h, kwargs["position_embeddings"])  # as the family builds them
            out.append((q.float(), repeat_kv_heads(k, q.shape[1]).float()))

        hooks.append(attn.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return out


def sampled_rows(qs: torch.Tensor, ks: torch.Tensor, n: int, g: torch.Generator, queries: int, scaling: float,
                 beyond: int, sinks: int, feats: tuple[torch.Tensor, torch.Tensor] | None = None,
                 cap: tuple[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``queries`` random query rows of sequence ``n`` (with history beyond the window when ``beyond`` > 0):
    the maps' inputs ``q (1, H, R, d)`` and ``k (1, H, T, d)`` (``feats``' queries and keys when given,
    else ``qs``, ``ks`` themselves), the keys each row attends ``keep (R, T)`` (causal, or beyond the
    window and past the ``sinks``) and the base's scaled scores ``(1, H, R, T)`` (from ``qs``, ``ks``;
    with ``cap`` = ``(distance, inv_freq)``, pairs farther apart scored at that distance, as the
    capped base scores them)."""
    T = qs.shape[2]
    lo = beyond + sinks + 16 if beyond else T // 8  # queries with some history (beyond the window)
    rows = torch.randint(lo, T, (queries,), generator=g).sort().values.to(qs.device)
    q, k = qs[n:n + 1, :, rows], ks[n:n + 1]
    j = torch.arange(T, device=qs.device)[None, :]
    keep = (j <= rows[:, None] - beyond) & (j >= sinks) if beyond else j <= rows[:, None]
    scores = q @ k.transpose(-1, -2)
    if cap is not None:
        distance, inv_freq = cap
        far = rope_rotate(rope_to_origin(qs[n:n + 1], inv_freq)[:, :, rows], torch.tensor(float(distance)), inv_freq)
        far = far @ rope_to_origin(k, inv_freq).transpose(-1, -2)
        scores = torch.where((rows[:, None] - j > distance)[None, None], far, scores)
    scores = scores * scaling
    if feats is not None:
        q, k = feats[0][n:n + 1, :, rows], feats[1][n:n + 1]
    return q, k, keep, scores


def fit_layer(qs: torch.Tensor, ks: torch.Tensor, scaling: float, features: int, steps: int, lr: float,
              queries: int, seed: int, beyond: int = 0, sinks: int = 0,
              feats: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hedgehog maps ``(Wq, Wk)`` ``(H, f, d)`` for one layer from ``qs``, ``ks`` ``(N, H, T, d)``;
    returns them with each head's first and last KL(softmax weights || kernel weights) per query
    (nats, ``(H,)``). The heads are fitted independently (Adam's steps are per weight), so the
    heads of several layers stacked along ``H`` fit in one call as they would one layer at a time.
    ``beyond`` > 0: fit the softmax restricted to the keys more than ``beyond`` - 1 tokens back
    (past the window) and not among the first ``sinks`` (what a memory beside the window returns).
    ``feats``: the maps' inputs when they are not ``qs``, ``ks`` (position-free ones, ``--distance``)."""
    g = torch.Generator().manual_seed(seed)
    N, H, T, d = qs.shape
    wq = torch.nn.Parameter((torch.randn(H, features, d, generator=g) * d ** -0.5).to(qs.device))
    wk = torch.nn.Parameter(wq.detach().clone())
    opt = torch.optim.Adam([wq, wk], lr=lr)
    first = last = None
    for step in range(steps):
        n = int(torch.randint(N, (1,), generator=g))
        q, k, causal, scores = sampled_rows(qs, ks, n, g, queries, scaling, beyond, sinks, feats)
        target = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        kappa = hedgehog(q, wq) @ hedgehog(k, wk).transpose(-1, -2) * causal
        logp = (kappa / kappa.sum(-1, keepdim=True)).clamp_min(1e-30).log()
        kl = (target * (target.clamp_min(1e-30).log() - logp)).sum(-1).mean((0, 2))  # (H,) KL(softmax || kernel)
        loss = kl.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = kl.detach() if step == 0 else first
        last = kl.detach()
    return wq.detach(), wk.detach(), first, last


@torch.no_grad()
def fit_log_scale(qs: torch.Tensor, ks: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, scaling: float,
                  beyond: int, sinks: int, queries: int, seed: int,
                  feats: tuple[torch.Tensor, torch.Tensor] | None = None,
                  cap: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
    """``(H, d + 2)``: per head, a linear function of the query whose value approximates
    ``log sum_j exp(s_tj) - log sum_j phi_q(q_t) . phi_k(k_j)`` over the keys ``j`` beyond the window,
    and of the log of their count ``n_t``, so that ``log K_t + [q_t, 1, log n_t] . coef`` estimates the softmax's unnormalised mass beyond the
    window from the linear state's normaliser ``K_t`` alone (least squares over sampled rows of
    every sequence). Mixed with the window's log-sum-exp, it gives the memory a share that a layer
    can compute without the keys it no longer holds."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for n in range(qs.shape[0]):
        q, k, keep, scores = sampled_rows(qs, ks, n, g, queries, scaling, beyond, sinks, feats, cap)
        lse = scores.masked_fill(~keep, float("-inf")).logsumexp(-1)  # (1, H, R)
        mass = (hedgehog(q, wq) @ hedgehog(k, wk).transpose(-1, -2) * keep).sum(-1).clamp_min(1e-30).log()
        log_count = keep.sum(-1).clamp_min(1).float().log()[None, :, None].expand(q.shape[1], -1, 1).to(q.device)
        xs.append(torch.cat([q[0], torch.ones_like(q[0, ..., :1]), log_count], dim=-1))  # (H, R, d + 2)
        ys.append((lse - mass)[0])  # (H, R)
    x, y = torch.cat(xs, dim=1), torch.cat(ys, dim=1)
    return torch.linalg.lstsq(x, y[..., None]).solution[..., 0]  # (H, d + 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--books", default="retrofit/data/pg-books")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--beyond", type=int, default=0, help="fit only the keys beyond a window of this many tokens")
    ap.add_argument("--sinks", type=int, default=4, help="with --beyond: the first tokens left out (the window's sinks)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="write this many long-range repeats (retrofit.data.recall, style repeats) into each sequence")
    ap.add_argument("--distance", type=int, default=None,
                    help="fit position-free maps: queries at this RoPE distance from keys rotated back to 0 "
                         "(the hedgehog method's memory_distance), against the base's true attention")
    ap.add_argument("--maps", type=Path, default=None,
                    help="keep the query / key maps of this earlier fit and fit the scale only (with --beyond)")
    ap.add_argument("--rope-cap", type=int, default=None,
                    help="the base with RoPE distances capped here (its strongest form past its context): "
                         "its hidden states and its scores, for fitting the scale on sequences past the context")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--joint", action="store_true",
                    help="fit every layer's heads in one loop (the same maps; fewer, larger steps, for a GPU)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model, tokenizer = load_any(args.model, dtype="float32")
    if args.rope_cap:
        cap_rope(model, args.rope_cap)
    if args.maps is not None and not args.beyond:
        raise SystemExit("error: --maps refits the scale only, which needs --beyond")
    earlier = load_file(str(args.maps)) if args.maps is not None else None
    model.to(args.device)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # the fit's products; the captured q, k are fp32
    text = "\n\n".join(read_text(f"{args.books}/{b}.txt") for b in BOOKS)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    step = len(ids) // args.sequences
    blocks = [np.asarray(ids[i * step:i * step + args.length], dtype=np.int64) for i in range(args.sequences)]
    if args.repeats:
        inserter = RecallInserter(RecallConfig(share=1.0, facts=args.repeats, min_distance=args.beyond + 76 if args.beyond else 1100,
                                               seed=args.seed, style="repeats"), make_tokenize(tokenizer, special_tokens=False))
        blocks = [inserter(b, i) for i, b in enumerate(blocks)]
    batch = torch.from_numpy(np.stack(blocks)).to(args.device)
    per_seq = [capture_qk(model, batch[i:i + 1]) for i in range(args.sequences)]
    layers = [layer.self_attn for layer in model.model.layers]
    groups = [list(range(len(layers)))] if args.joint else [[li] for li in range(len(layers))]
    if args.joint and len({attn.scaling for attn in layers}) > 1:
        raise SystemExit("error: --joint needs one attention scaling in every layer")
    tensors, log = {}, []
    start = time.time()
    for group in groups:  # the layers fitted together: their heads stacked along H
        qs = torch.cat([torch.cat([p[li][0] for p in per_seq]) for li in group], dim=1)
        ks = torch.cat([torch.cat([p[li][1] for p in per_seq]) for li in group], dim=1)
        feats = None
        if args.distance is not None:  # every sequence sits at positions 0..T-1: rotate back to 0, queries to D
            inv_freq = get_patch(model).rope_inv_freq(layers[group[0]]).to(qs.device)
            feats = (rope_rotate(rope_to_origin(qs, inv_freq), torch.tensor(float(args.distance)), inv_freq),
                     rope_to_origin(ks, inv_freq))
        if earlier is None:
            wq, wk, first, last = fit_layer(qs, ks, layers[group[0]].scaling, args.features, args.steps, args.lr,
                                            args.queries, args.seed + group[0], args.beyond,
                                            args.sinks if args.beyond else 0, feats)
        else:
            wq = torch.cat([earlier[f"layers.{li}.query"] for li in group]).to(qs.device)
            wk = torch.cat([earlier[f"layers.{li}.key"] for li in group]).to(qs.device)
            first = last = torch.zeros(wq.shape[0])  # not fitted here
        cap = None
        if args.rope_cap:
            cap = (args.rope_cap, get_patch(model).rope_inv_freq(layers[group[0]]).to(qs.device))
        scale = fit_log_scale(qs, ks, wq, wk, layers[group[0]].scaling, args.beyond, args.sinks,
                              args.queries, args.seed + group[0], feats, cap) if args.beyond else None
        del qs, ks, feats
        for i, li in enumerate(group):
            heads = slice(i * wq.shape[0] // len(group), (i + 1) * wq.shape[0] // len(group))
            tensors[f"layers.{li}.query"] = wq[heads].cpu().contiguous()
            tensors[f"layers.{li}.key"] = wk[heads].cpu().contiguous()
            if scale is not None:
                tensors[f"layers.{li}.log_scale"] = scale[heads].cpu().contiguous()
            log.append({"layer": li, "kl_first": float(first[heads].mean()), "kl_last": float(last[heads].mean())})
            print(json.dumps(log[-1] | {"minutes": round((time.time() - start) / 60, 1)}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(args.out, save(tensors, metadata={"args": json.dumps(vars(args) | {"out": str(args.out), "maps": args.maps and str(args.maps)}),
                                                         "log": json.dumps(log)}))


if __name__ == "__main__":
    main()
