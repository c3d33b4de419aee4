"""What a memory beside the window would need to carry a passkey: oracle memories in every layer.

Every trained conversion of SmolLM2-135M scores the passkey's lead digit at chance beyond its
window. This asks which part of the memory is missing, without training: each layer of a
``method: delta`` conversion keeps its frozen window and sinks, and its memory is replaced by an
oracle built from the base's own attention at the last ``--tail`` positions (the question and the
key; closed before them, so nothing else changes), and each rung of the ladder below removes one thing
the trained memory would have to learn:

* ``exact``: the memory returns the full attention's part beyond the window, ``P_out V`` (the
  share ``m_t`` = the full attention's mass beyond the window, per head and token). The model is
  then the base up to the sinks' capped distance: the check that the rungs below are built right.
* ``needle-softmax``: with share ``m_t``, the memory returns a softmax over the needle's tokens
  only: the base's attention, had the memory stored the needle and nothing else.
* ``needle-<kernel>``: the same read with the softmax's exp replaced by another kernel of the
  query and the needle's keys, normalised over the needle: ``relu`` (``max(x, 0)`` of the scaled
  score ``x``) and ``cos`` (``max(cos, 0)``) are sharp but not products of features, so no
  linear-time state holds them (diagnostics of how sharp a read must be); ``taylor2``
  (``1 + x + x^2/2``, Based's kernel), ``relufeat`` (``relu(q) . relu(k)``) and ``expfeat``
  (``exp(q) . exp(k)`` per feature, the exp(Q)exp(K) method's) are; ``additive`` is the
  unnormalised sum of ``cos(q, k_j) v_j`` (an additive memory of unit keys); ``hedgehog``
  (``--feature-maps``): learned spiky features, fitted to the base's attention by ``hedgehog_fit.py``.
* ``all-<kernel>``: the same kernels over every key beyond the window (needle and haystack): a
  memory that writes everything with the same strength.
* ``needle-delta``: with share ``m_t``, the delta-rule memory written at the needle's tokens only
  (beta 1, no decay) and read the way the layer reads it (L2-normalised post-RoPE keys and
  queries through the conversion's maps, unnormalised): perfect writes, the layer's own read.
* ``needle-delta-nope``: the same with the rotary embedding undone on the memory's keys and
  queries (pre-RoPE, position-free content keys).
* ``all-delta``: with share ``m_t``, the memory as the conversion writes it (every token, its own
  write strength and decay): an oracle gate only.
* ``all-delta-nope``: the same on pre-RoPE keys and queries.
* ``closed``: the window and sinks alone (m = 0), the floor.
* ``model``: the conversion as it is (its own gate, writes and reads).

Scored teacher-forced on the passkey evaluator's plain prompts with the key at depth 0 (beyond
the window), as ``recall_probe.py`` scores them: top-1 over the key's tokens, its lead digit, NLL.

    python scripts/research/oracle_memory.py runs/gpu-delta/smollm2-delta --lengths 2048 --trials 10 \
        --out runs/oracle/oracle.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from retrofit.eval.loading import load_model
from retrofit.eval.passkey import NEEDLE, prompt_grid
from retrofit.eval.windows import encode
from retrofit.fs.atomic import write_json_atomic
from retrofit.layers.delta import DeltaAttention
from retrofit.ops import delta_rule_chunked, repeat_kv_heads
from retrofit.ops.rope import rope_to_origin
from retrofit.surgery.distill import converted_modules

from hedgehog_fit import hedgehog  # noqa: E402  (same folder)
from recall_probe import _Tally  # noqa: E402

KERNELS = ("softmax", "relu", "cos", "taylor2", "relufeat", "expfeat", "hedgehog", "additive")
RUNGS = ("closed", "exact", *(f"needle-{k}" for k in KERNELS), "needle-delta", "needle-delta-nope",
         *(f"all-{k}" for k in KERNELS[1:]), "all-delta", "all-delta-nope", "model")


def kernel_read(q: torch.Tensor, k: torch.Tensor, scaling: float, keep: torch.Tensor, v: torch.Tensor,
                kind: str, maps: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``(B, H, R, D)``: the values ``v (B, H, T, D)`` over the keys in ``keep (R, T)``, weighted by
    ``kind``'s kernel of the queries ``q (B, H, R, d)`` and keys ``k (B, H, T, d)`` (rows with no key: 0).
    Normalised (weights summing to 1) except ``additive``; ``maps``: the layer's Hedgehog maps."""
    x = (q @ k.transpose(-1, -2)) * scaling
    if kind == "softmax":
        return torch.nan_to_num(x.masked_fill(~keep, float("-inf")).softmax(-1)) @ v
    if kind == "relu":  # max(x, 0): sharp, but not a product of features (no linear-time state holds it)
        kappa = x.clamp_min(0)
    elif kind == "cos":  # max(cos, 0): the same on L2-normalised keys and queries (not a state either)
        kappa = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)).clamp_min(0)
    elif kind == "taylor2":  # 1 + x + x^2/2 = phi(q) . phi(k) with d^2 + d + 1 features (Based)
        kappa = 1 + x + x * x / 2
    elif kind == "relufeat":  # relu(q) . relu(k)
        kappa = (q.clamp_min(0) @ k.clamp_min(0).transpose(-1, -2)) * scaling
    elif kind == "expfeat":  # exp(q) . exp(k) per feature (the exp(Q)exp(K) method's kernel)
        s = scaling ** 0.5
        qe = (q * s - (q * s).amax(-1, keepdim=True)).exp()
        ke = (k * s - (k * s).amax(-1, keepdim=True)).exp()  # a per-key factor would bias the keys: keep it
        kappa = (qe @ ke.transpose(-1, -2)) * (k * s).amax(-1)[..., None, :].exp()
    elif kind == "hedgehog":  # learned spiky features (hedgehog_fit.py): phi_q(q) . phi_k(k)
        kappa = hedgehog(q, maps[0]) @ hedgehog(k, maps[1]).transpose(-1, -2)
    elif kind == "additive":  # sum of cos(q, k_j) v_j, unnormalised: an additive memory of unit keys
        return ((F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)) * keep) @ v
    else:
        raise ValueError(kind)
    kappa = kappa * keep
    return kappa / kappa.sum(-1, keepdim=True).clamp_min(1e-30) @ v


def oracle_attend(layer: DeltaAttention, rung: str, needle: tuple[int, int], tail: int, inv_freq: torch.Tensor,
                  maps=None):
    """An ``attend`` for ``layer`` with its memory replaced by ``rung``'s oracle at the last ``tail``
    positions (the question and the key) and closed before them."""

    def attend(q, k, v, valid, cache, *, hidden_states, position_embeddings):
        B, H, T, _ = q.shape
        R = min(tail, T)
        w, n_sinks = layer.window, layer.sinks or 0
        kr, vr = repeat_kv_heads(k, H).float(), repeat_kv_heads(v, H).float()
        t_idx, j_idx = torch.arange(T - R, T)[:, None], torch.arange(T)[None, :]
        scores = (q[:, :, -R:].float() @ kr.transpose(-1, -2)) * layer.scaling  # (B, H, R, T)
        scores = scores.masked_fill(j_idx > t_idx, float("-inf"))
        probs = scores.softmax(-1)
        beyond = (j_idx <= t_idx - w) & (j_idx >= n_sinks)  # (R, T): beyond the window, not a sink
        share = torch.zeros(B, H, T)
        share[:, :, -R:] = (probs * beyond).sum(-1)  # the full attention's mass beyond the window
        if rung == "closed":
            share.zero_()
        share = share.clamp(1e-9, 1 - 1e-6)
        mix = torch.stack([torch.log1p(-share), torch.log(share)], dim=-1)
        window_part = layer.mixed_attention(q, k, v, valid, cache, mix.to(q.dtype), None, None)  # (1 - m) SWA
        if rung == "closed":
            return window_part
        read = torch.zeros(B, H, T, vr.shape[-1])
        lo, hi = needle
        in_needle = beyond & (j_idx >= lo) & (j_idx < hi)
        if rung == "exact":
            read[:, :, -R:] = (probs * beyond) @ vr / share[:, :, -R:, None]
        elif rung.split("-", 1)[1] in KERNELS:
            keep = in_needle if rung.startswith("needle-") else beyond
            read[:, :, -R:] = kernel_read(q[:, :, -R:].float(), kr, layer.scaling, keep, vr, rung.split("-", 1)[1],
                                          maps)
        else:
            if rung.endswith("-nope"):  # the prompt starts at position 0: rotate each token back there
                q, k = rope_to_origin(q, inv_freq), rope_to_origin(k, inv_freq)
            mq, mk, mv, beta, g = layer.memory_inputs(q, k, v, hidden_states)
            if rung.startswith("needle"):
                beta = torch.zeros_like(beta)
                beta[..., lo:hi] = 1.0
                g = None
            read = delta_rule_chunked(mq, mk, mv, beta, g, chunk_size=layer.chunk_size)[0].float()
        return window_part + (share[..., None] * read).to(window_part.dtype)

    return attend


def set_rung(model, rung: str, needle: tuple[int, int], tail: int, maps: dict | None = None) -> None:
    inv_freq = model.model.rotary_emb.inv_freq
    for m in converted_modules(model):
        if rung == "model":
            m.__dict__.pop("attend", None)
        else:
            li = int(m.layer_idx)
            layer_maps = (maps[f"layers.{li}.query"], maps[f"layers.{li}.key"]) if maps else None
            m.attend = oracle_attend(m, rung, needle, tail, inv_freq, layer_maps)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a method: delta conversion (folder or delta)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--rungs", nargs="+", default=[r for r in RUNGS if not r.endswith("-hedgehog")], choices=RUNGS)
    ap.add_argument("--feature-maps", type=Path, default=None, help="hedgehog_fit.py's maps (rungs *-hedgehog)")
    ap.add_argument("--tail", type=int, default=32, help="positions at the end (question and key) given the oracle")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model, tokenizer = load_model(args.model, dtype="float32")
    model.eval()
    maps = load_file(str(args.feature_maps)) if args.feature_maps else None
    if maps is None and any(r.endswith("-hedgehog") for r in args.rungs):
        raise SystemExit("error: the *-hedgehog rungs need --feature-maps (from hedgehog_fit.py)")
    if not all(isinstance(m, DeltaAttention) for m in converted_modules(model)):
        raise SystemExit("error: oracle_memory.py needs a method: delta conversion (every layer DeltaAttention)")
    results = []
    for length in args.lengths:
        prompts = prompt_grid(tokenizer, [length - 8], [0.0], trials=args.trials, seed=0)
        for rung in args.rungs:
            tally = _Tally()
            for p in prompts:
                key_ids = encode(tokenizer, " " + p["key"])
                ids = p["ids"] + key_ids
                needle = (p["needle_at"], p["needle_at"] + len(encode(tokenizer, NEEDLE.format(key=p["key"]))))
                set_rung(model, rung, needle, args.tail, maps)
                logp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
                tally.add(logp, len(ids) - len(key_ids), key_ids, tokenizer)
            set_rung(model, "model", (0, 0), 0)
            row = {"length": length, "rung": rung, "trials": len(prompts), **tally.scores("pk_")}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_json_atomic(args.out, {"model": args.model, "results": results}, indent=1)


if __name__ == "__main__":
    main()
