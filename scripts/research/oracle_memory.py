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
* On the fitted Hedgehog read, what a layer could realize: ``*-hhdelta``, the delta rule (beta 1,
  no decay) on its L2-normalised features, every key (or the needle's) written as it leaves the
  window; ``all-hedgehog-gate`` and ``all-hhdelta-gate``, the conversion's own trained gate as the
  share; ``all-hedgehog-lse``, the share from the read's own mass against the window's
  log-sum-exp (``hedgehog_fit.py``'s ``log_scale``). ``all-hhtop`` keeps each row's ``--top``
  largest kernel weights: a ranking diagnostic, not a state.

A kernel rung also reports its weight on the needle against the base's, overall and in the heads
and rows where the base puts more than half its weight beyond the window on the needle
(``needle_mass_retrieval_heads``); an ``-lse`` rung its share against the base's.
``--ppl-text`` scores perplexity with the oracle at every position instead of the tail (the
``needle-`` rungs left out), the twin's gap read as closed -> exact.

Scored teacher-forced on the passkey evaluator's plain prompts with the key at ``--depths``
(default 0, beyond the window), as ``recall_probe.py`` scores them: top-1 over the key's tokens,
its lead digit, NLL. ``--device cuda`` runs it on a GPU (``scripts/gpu/run.sh oracle-fit-512``).

    python scripts/research/oracle_memory.py runs/gpu-delta/smollm2-delta --lengths 2048 --trials 10 \
        --out runs/oracle/oracle.json
"""
from __future__ import annotations

import argparse
import json
import math
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
from recall_probe import Tally  # noqa: E402

KERNELS = ("softmax", "relu", "cos", "taylor2", "relufeat", "expfeat", "hedgehog", "additive")
RUNGS = ("closed", "exact", *(f"needle-{k}" for k in KERNELS), "needle-delta", "needle-delta-nope",
         *(f"all-{k}" for k in KERNELS[1:]), "all-delta", "all-delta-nope", "model",
         # realizable writes and shares on the fitted Hedgehog read (and one ranking diagnostic)
         "needle-hhdelta", "all-hhdelta", "all-hhtop", "all-hedgehog-gate", "all-hhdelta-gate", "all-hedgehog-lse")


def kernel_read(q: torch.Tensor, k: torch.Tensor, scaling: float, keep: torch.Tensor, v: torch.Tensor,
                kind: str, maps: tuple[torch.Tensor, torch.Tensor] | None = None, top: int = 32,
                details: bool = False):
    """``(B, H, R, D)``: the values ``v (B, H, T, D)`` over the keys in ``keep (R, T)``, weighted by
    ``kind``'s kernel of the queries ``q (B, H, R, d)`` and keys ``k (B, H, T, d)`` (rows with no key: 0).
    Normalised (weights summing to 1) except ``additive``; ``maps``: the layer's Hedgehog maps;
    ``hhtop``: the Hedgehog kernel kept at its ``top`` largest keys a row (a ranking diagnostic);
    ``details``: ``(read, weights (B, H, R, T), mass (B, H, R))``, the normalised weights and their
    normaliser, the kernel's sum over the kept keys (not for softmax and additive)."""
    x = (q @ k.transpose(-1, -2)) * scaling if kind in ("softmax", "relu", "taylor2") else None
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
    elif kind in ("hedgehog", "hhtop"):  # learned spiky features (hedgehog_fit.py): phi_q(q) . phi_k(k)
        kappa = hedgehog(q, maps[0]) @ hedgehog(k, maps[1]).transpose(-1, -2)
        if kind == "hhtop":
            kappa = kappa * keep
            kth = kappa.topk(min(top, kappa.shape[-1]), dim=-1).values[..., -1:]
            keep = keep & (kappa >= kth)
    elif kind == "additive":  # sum of cos(q, k_j) v_j, unnormalised: an additive memory of unit keys
        return ((F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)) * keep) @ v
    else:
        raise ValueError(kind)
    kappa = kappa * keep
    mass = kappa.sum(-1, keepdim=True)
    weights = kappa / mass.clamp_min(1e-30)
    return (weights @ v, weights, mass[..., 0]) if details else weights @ v


def hedgehog_delta_read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, maps: tuple[torch.Tensor, torch.Tensor],
                        window: int, sinks: int, needle: tuple[int, int] | None) -> torch.Tensor:
    """``(B, H, T, D)``: the delta rule (beta 1, no decay) on L2-normalised Hedgehog features, where the
    query at ``t`` reads the memory written with every key ``j <= t - window`` past the ``sinks``
    (``needle``: only the keys in ``[lo, hi)``). The write of key ``t - window`` happens at step ``t``,
    so one causal pass of ``delta_rule_chunked`` gives every position its own memory."""
    T = q.shape[2]
    fq = F.normalize(hedgehog(q, maps[0]), dim=-1)
    fk = F.normalize(hedgehog(k, maps[1]), dim=-1)
    shift_k, shift_v = torch.zeros_like(fk), torch.zeros_like(v)
    beta = torch.zeros(q.shape[:3], device=q.device)
    if T > window:
        shift_k[:, :, window:], shift_v[:, :, window:] = fk[:, :, :T - window], v[:, :, :T - window]
        j = torch.arange(T - window, device=q.device)  # the key written at step j + window
        write = j >= sinks
        if needle is not None:
            write &= (j >= needle[0]) & (j < needle[1])
        beta[:, :, window:] = write.float()
    return delta_rule_chunked(fq, shift_k, shift_v, beta, None)[0]


def oracle_attend(layer: DeltaAttention, rung: str, needle: tuple[int, int], tail: int, inv_freq: torch.Tensor,
                  maps=None, top: int = 32, stats: list | None = None):
    """An ``attend`` for ``layer`` with its memory replaced by ``rung``'s oracle at the last ``tail``
    positions (the question and the key; every position when ``tail`` >= T) and closed before them.
    The share of the memory is the base's attention mass beyond the window, with ``-gate`` the
    layer's own trained gate, with ``-lse`` one a layer could compute: the Hedgehog read's own mass
    ``sum_j phi_q(q_t) . phi_k(k_j)`` times a fitted per-head scale (``hedgehog_fit.py``'s
    ``log_scale``, linear in the query), against the window's log-sum-exp: ``sigmoid(log mass +
    log_scale(q_t) - lse_window(t))``. ``stats``: gets a dict per call of a kernel rung (its weight
    on the needle and the base's, see ``summarize``) or of an ``-lse`` rung (its share and the base's)."""
    scope, _, kind = rung.partition("-")
    own_gate, lse_share = kind.endswith("-gate"), kind.endswith("-lse")
    kind = kind.removesuffix("-gate").removesuffix("-lse")

    def attend(q, k, v, valid, cache, *, hidden_states, position_embeddings):
        B, H, T, _ = q.shape
        dev = q.device
        R = min(tail, T)
        w, n_sinks = layer.window, layer.sinks or 0
        kr, vr = repeat_kv_heads(k, H).float(), repeat_kv_heads(v, H).float()
        t_idx, j_idx = torch.arange(T - R, T, device=dev)[:, None], torch.arange(T, device=dev)[None, :]
        beyond = (j_idx <= t_idx - w) & (j_idx >= n_sinks)  # (R, T): beyond the window, not a sink
        share = torch.zeros(B, H, T, device=dev)
        if own_gate:
            share[:, :, -R:] = layer.memory_share(layer.mixing_logits(hidden_states, valid, None)[0])[..., -R:, 0]
        elif rung != "closed":
            scores = (q[:, :, -R:].float() @ kr.transpose(-1, -2)) * layer.scaling  # (B, H, R, T)
            probs = scores.masked_fill(j_idx > t_idx, float("-inf")).softmax(-1)
            share[:, :, -R:] = (probs * beyond).sum(-1)  # the full attention's mass beyond the window
            if lse_share:  # realizable: the read's own mass (fitted scale) against the window's log-sum-exp
                qt, oracle = q[:, :, -R:].float(), share[:, :, -R:].clone()
                tail_read, _, mass = kernel_read(qt, kr, layer.scaling, beyond, vr, kind, maps, top, details=True)
                d = qt.shape[-1]  # log_scale (H, d + 1): [a, b]; (H, d + 2): [a, b, g] with g . log(key count)
                log_scale = torch.einsum("bhrd,hd->bhr", qt, maps[2][:, :d]) + maps[2][:, d][None, :, None]
                if maps[2].shape[1] == d + 2:
                    log_scale = log_scale + maps[2][:, d + 1][None, :, None] * beyond.sum(-1).clamp_min(1).log()
                lse_window = scores.masked_fill(beyond | (j_idx > t_idx), float("-inf")).logsumexp(-1)
                share[:, :, -R:] = torch.where(mass > 0, torch.sigmoid(mass.clamp_min(1e-30).log() + log_scale
                                                                       - lse_window), 0.0)
                if stats is not None:
                    ours = share[:, :, -R:]
                    stats.append({"share_base": oracle.mean().item(), "share": ours.mean().item(),
                                  "share_abs_err": (ours - oracle).abs().mean().item()})
            del scores
        share = share.clamp(1e-9, 1 - 1e-6)
        mix = torch.stack([torch.log1p(-share), torch.log(share)], dim=-1)
        window_part = layer.mixed_attention(q, k, v, valid, cache, mix.to(q.dtype), chunk_size=layer.chunk_size)  # (1 - m) SWA
        if rung == "closed":
            return window_part
        read = torch.zeros(B, H, T, vr.shape[-1], device=dev)
        lo, hi = needle
        in_needle = beyond & (j_idx >= lo) & (j_idx < hi)
        if rung == "exact":
            read[:, :, -R:] = (probs * beyond) @ vr / share[:, :, -R:, None]
        elif lse_share:  # the read its share came from
            read[:, :, -R:] = tail_read
        elif kind in KERNELS or kind == "hhtop":
            keep = in_needle if scope == "needle" else beyond
            if stats is not None and kind not in ("softmax", "additive") and not own_gate:
                read[:, :, -R:], weights, _ = kernel_read(q[:, :, -R:].float(), kr, layer.scaling, keep, vr, kind,
                                                          maps, top, details=True)
                ours = (weights * in_needle).sum(-1)  # (B, H, R)
                base = (probs * beyond * in_needle).sum(-1) / share[:, :, -R:]
                sharp = base > 0.5  # heads and rows where the base reads mostly the needle (retrieval heads)
                stats.append({"needle_mass": ours.mean().item(), "needle_mass_base": base.mean().item(),
                              "sharp_sum": ours[sharp].sum().item(), "sharp_rows": int(sharp.sum())})
            else:
                read[:, :, -R:] = kernel_read(q[:, :, -R:].float(), kr, layer.scaling, keep, vr, kind, maps, top)
        elif kind == "hhdelta":
            read = hedgehog_delta_read(q.float(), kr, vr, maps, w, n_sinks, needle if scope == "needle" else None)
        else:
            if kind.endswith("-nope"):  # the prompt starts at position 0: rotate each token back there
                q, k = rope_to_origin(q, inv_freq), rope_to_origin(k, inv_freq)
            mq, mk, mv, beta, g = layer.memory_inputs(q, k, v, hidden_states)
            if scope == "needle":
                beta = torch.zeros_like(beta)
                beta[..., lo:hi] = 1.0
                g = None
            read = delta_rule_chunked(mq, mk, mv, beta, g, chunk_size=layer.chunk_size)[0].float()
        return window_part + (share[..., None] * read).to(window_part.dtype)

    return attend


def set_rung(model, rung: str, needle: tuple[int, int], tail: int, maps: dict | None = None, top: int = 32,
             stats: list | None = None) -> None:
    inv_freq = model.model.rotary_emb.inv_freq
    for m in converted_modules(model):
        if rung == "model":
            m.__dict__.pop("attend", None)
        else:
            li = int(m.layer_idx)
            layer_maps = (maps[f"layers.{li}.query"], maps[f"layers.{li}.key"],
                          maps.get(f"layers.{li}.log_scale")) if maps else None
            m.attend = oracle_attend(m, rung, needle, tail, inv_freq, layer_maps, top, stats)


def summarize(stats: list[dict], prompts: int) -> dict[str, float]:
    """The means of what ``oracle_attend`` recorded over layers and forwards: the read's weight on the
    needle against the base's (beyond the window; in retrieval heads, where the base's is over 1/2),
    and a realizable share against the base's."""
    out = {}
    for key in ("needle_mass", "needle_mass_base", "share_base", "share", "share_abs_err"):
        values = [s[key] for s in stats if key in s]
        if values:
            out[key] = sum(values) / len(values)
    sharp = sum(s.get("sharp_rows", 0) for s in stats)
    if sharp:
        out["needle_mass_retrieval_heads"] = sum(s["sharp_sum"] for s in stats) / sharp
        out["retrieval_head_rows"] = sharp / prompts
    return out


def passkey_rows(model, tokenizer, args, maps) -> list[dict]:
    """Teacher-forced passkey scores of every rung at ``args.lengths`` x ``args.depths``."""
    rows, dev = [], args.device
    for length in args.lengths:
        for depth in args.depths:
            prompts = prompt_grid(tokenizer, [length - 8], [depth], trials=args.trials, seed=0)
            for rung in args.rungs:
                tally, stats = Tally(), []
                for p in prompts:
                    key_ids = encode(tokenizer, " " + p["key"])
                    ids = p["ids"] + key_ids
                    needle = (p["needle_at"], p["needle_at"] + len(encode(tokenizer, NEEDLE.format(key=p["key"]))))
                    set_rung(model, rung, needle, args.tail, maps, args.top, stats)
                    logp = model(input_ids=torch.tensor([ids], device=dev)).logits[0].float().log_softmax(-1).cpu()
                    tally.add(logp, len(ids) - len(key_ids), key_ids, tokenizer)
                set_rung(model, "model", (0, 0), 0)
                rows.append({"length": length, "depth": depth, "rung": rung, "trials": len(prompts),
                             **tally.scores("pk_")})
                rows[-1] |= summarize(stats, len(prompts))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def perplexity_rows(model, tokenizer, args, maps) -> list[dict]:
    """Each rung's perplexity on ``args.ppl_text``'s first ``args.ppl_windows`` windows of each length,
    the oracle at every position (what the memory would give the whole text, not only the key)."""
    ids = encode(tokenizer, Path(args.ppl_text).read_text(encoding="utf-8"))
    rows = []
    for length in args.ppl_lengths or args.lengths:
        windows = [ids[i * length:(i + 1) * length] for i in range(args.ppl_windows)]
        if len(windows[-1]) < length:
            raise SystemExit(f"error: {args.ppl_text} has fewer than {args.ppl_windows} windows of {length} tokens")
        for rung in [r for r in args.ppl_rungs or args.rungs if not r.startswith("needle-")]:  # no needle here
            nll, count, stats = 0.0, 0, []
            for window in windows:
                set_rung(model, rung, (0, 0), length, maps, args.top, stats)
                x = torch.tensor([window], device=args.device)
                logits = model(input_ids=x).logits[0, :-1].float()
                nll += float(F.cross_entropy(logits, x[0, 1:], reduction="sum"))
                count += length - 1
            set_rung(model, "model", (0, 0), 0)
            rows.append({"length": length, "rung": rung, "windows": len(windows), "nll": nll / count,
                         "ppl": math.exp(nll / count),
                         **{k: v for k, v in summarize(stats, len(windows)).items() if not k.startswith("needle")}})
            print(json.dumps(rows[-1]), flush=True)
    return rows


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a method: delta conversion (folder or delta)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0], help="the key's depths in the passkey prompt")
    ap.add_argument("--trials", type=int, default=10, help="passkey prompts a length and depth (0: no passkey)")
    ap.add_argument("--rungs", nargs="+", default=[r for r in RUNGS if "hedgehog" not in r and "hh" not in r],
                    choices=RUNGS)
    ap.add_argument("--feature-maps", type=Path, default=None, help="hedgehog_fit.py's maps (rungs *-hedgehog, *-hh*)")
    ap.add_argument("--tail", type=int, default=32, help="positions at the end (question and key) given the oracle")
    ap.add_argument("--hedgehog-scale", type=float, default=1.0,
                    help="multiply the Hedgehog maps' weights (a sharper read above 1, the same state)")
    ap.add_argument("--top", type=int, default=32, help="keys a row keeps in the all-hhtop rung")
    ap.add_argument("--ppl-text", type=Path, default=None,
                    help="also score perplexity on this text (the oracle at every position)")
    ap.add_argument("--ppl-lengths", type=int, nargs="+", default=None, help="with --ppl-text (default: --lengths)")
    ap.add_argument("--ppl-rungs", nargs="+", default=None, choices=RUNGS, help="with --ppl-text (default: --rungs)")
    ap.add_argument("--ppl-windows", type=int, default=1, help="with --ppl-text: consecutive windows a length")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model, tokenizer = load_model(args.model, dtype="float32", device=args.device)
    model.eval()
    maps = load_file(str(args.feature_maps), device=args.device) if args.feature_maps else None
    if maps is not None:
        maps = {name: w if name.endswith("log_scale") else w * args.hedgehog_scale for name, w in maps.items()}
    if maps is None and any("hedgehog" in r or "-hh" in r for r in args.rungs + (args.ppl_rungs or [])):
        raise SystemExit("error: the *-hedgehog and *-hh* rungs need --feature-maps (from hedgehog_fit.py)")
    if not all(isinstance(m, DeltaAttention) for m in converted_modules(model)):
        raise SystemExit("error: oracle_memory.py needs a method: delta conversion (every layer DeltaAttention)")
    rows = [{"task": "passkey"} | r for r in passkey_rows(model, tokenizer, args, maps)] if args.trials else []
    if args.ppl_text:
        rows += [{"task": "ppl"} | r for r in perplexity_rows(model, tokenizer, args, maps)]
    if args.out:
        write_json_atomic(args.out, {"model": args.model, "args": {k: str(v) if isinstance(v, Path) else v
                                                                  for k, v in vars(args).items()},
                                     "results": rows}, indent=1)


if __name__ == "__main__":
    main()
