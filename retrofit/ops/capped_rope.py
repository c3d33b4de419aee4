"""Causal softmax attention with every RoPE distance capped at ``distance`` (ReRoPE-style).

A full-attention layer asked to look farther back than its pretraining context meets RoPE
rotations it never saw (Gemma 3 270M, pretrained at 32K, scores 29.8 perplexity over a 64K
window of a held-out book against 22.9 at 32K). Here a query at ``t`` and a key at ``j`` with
``t - j > distance`` are scored as if exactly ``distance`` apart, the rule :mod:`.sinks` applies
to attention sinks, now for every key:

    s(t, j) = R(t) q_t . R(j) k_j                 t - j <= distance  (unchanged)
            = R(distance) q_t . k_j               t - j >  distance  (the key at position 0)

so nothing changes inside the cap, and past it the layer still reaches every key (retrieval by
content stays possible) at a distance it was trained on. Inputs are post-RoPE (what the family
forward and the KV cache hold): the far scores re-rotate them with :func:`.rope.rope_rotate`
(``R(distance - t)`` on the query, ``R(-j)`` on the key). Positions are stream indices: key
``j`` of ``k`` sits at ``j``, query ``i`` at ``q_start + i`` (default ``Tk - Tq``: the queries
are the last keys); a per-row constant offset (left padding) cancels in both scores.

The fast form runs blocks of queries through one softmax over ``[far keys | near keys]``: far
keys carry ``[0, R(-j) k_j]``, near keys ``[R(j) k_j, 0]`` and the queries ``[R(t) q_t,
R(distance) q_t]``, so one product of width ``2d`` gives each pair its own score; a bool mask
picks, for each pair, the copy that applies. Keys wholly before a block's cap are only in the
far copy and keys within it only in the near copy, so a block scores ``Tk + block`` keys, not
``2 Tk``. That is SDPA's fused softmax (no ``Tq x Tk`` float scores kept) unless ``softcap`` is
set (Gemma 2), where the scores are formed explicitly in fp32.

Shapes: q ``(B, Hq, Tq, d)``, k ``(B, Hkv, Tk, d)``, v ``(B, Hkv, Tk, Dv)``, ``Hq % Hkv == 0``;
``key_padding_mask`` ``(B, Tk)`` True for real tokens (a padded query sees only itself; its
output is zero). ``inv_freq`` ``(F,)``: the layer's rotary frequencies (``2F <= d``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from retrofit.ops.rope import rope_rotate, rope_to_origin
from retrofit.ops.slots import masked_dense_attention

__all__ = ["capped_rope_attention", "capped_rope_attention_reference"]

DEFAULT_BLOCK = 1024  # queries per softmax block: bounds the mask / scores at block x (Tk + block)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, distance: int, q_start: int | None) -> int:
    Tq, Tk = q.shape[2], k.shape[2]
    if distance < 1:
        raise ValueError(f"distance must be >= 1, got {distance}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k.shape[1]} key heads")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k has {k.shape[2]} positions, v {v.shape[2]}")
    q_start = Tk - Tq if q_start is None else int(q_start)
    if q_start < 0 or q_start + Tq > Tk:
        raise ValueError(f"queries at {q_start}..{q_start + Tq - 1} do not lie among the {Tk} keys")
    return q_start


def capped_rope_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    distance: int,
    inv_freq: torch.Tensor,
    *,
    q_start: int | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense reference: every pair scored at its own capped distance ``min(t - j, distance)``.

    q and k are rotated back to position 0, then each query to each pair's distance (an explicit
    ``Tq x Tk`` rotation).

    Args:
        q, k, v, distance, inv_freq, q_start, scaling, softcap, key_padding_mask: as
            :func:`capped_rope_attention`.

    Returns:
        ``(B, Hq, Tq, Dv)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import capped_rope_attention_reference
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
        >>> capped_rope_attention_reference(q, k, v, 5, inv_freq).shape
        torch.Size([1, 4, 12, 8])
    """
    q_start = _check(q, k, v, distance, q_start)
    B, Hq, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    t = torch.arange(q_start, q_start + Tq, device=q.device)
    j = torch.arange(Tk, device=q.device)
    q0 = rope_rotate(q, -t, inv_freq)  # (B, Hq, Tq, d) at position 0
    k0 = rope_rotate(k, -j, inv_freq).repeat_interleave(group, dim=1)
    rel = (t[:, None] - j[None, :]).clamp(min=0, max=distance)  # (Tq, Tk)
    q_at = rope_rotate(q0[:, :, :, None, :].expand(B, Hq, Tq, Tk, d), rel, inv_freq)  # query moved to the distance
    s = (q_at.double() * k0[:, :, None].double()).sum(-1) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    allowed = (t[:, None] >= j[None, :])[None]  # (1, Tq, Tk)
    if key_padding_mask is not None:
        kpm = key_padding_mask.bool()
        q_valid = kpm[:, q_start : q_start + Tq]
        allowed = (allowed & kpm[:, None, :]) | ((t[:, None] == j[None, :])[None] & ~q_valid[:, :, None])
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.matmul(p, v.double().repeat_interleave(group, dim=1)).to(v.dtype)
    if key_padding_mask is not None:
        out = out * q_valid[:, None, :, None].to(out.dtype)
    return out


def _cpu_flash_with_lse():
    """torch's fused CPU attention that also returns the log-sum-exp (a private aten op; its
    log-sum-exp carries no gradient, so it serves calls without autograd only)."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def capped_rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    distance: int,
    inv_freq: torch.Tensor,
    *,
    q_start: int | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK,
    split: bool | None = None,
) -> torch.Tensor:
    """Causal attention with RoPE distances capped at ``distance`` (module docstring). Differentiable in q, k, v.

    Equals plain causal attention when no pair is farther apart than ``distance``. ``split``
    (default: on a CPU, without autograd or soft-capping): score the near and far keys in two
    fused softmaxes of width ``d`` merged by their log-sum-exps, instead of one of width ``2d``
    (half the score work; the log-sum-exp comes from a private op without a gradient).

    Args:
        q: ``(B, Hq, Tq, d)`` post-RoPE queries.
        k: ``(B, Hkv, Tk, d)`` post-RoPE keys (``Hq % Hkv == 0``).
        v: ``(B, Hkv, Tk, Dv)`` values.
        distance: the cap (``>= 1``): pairs farther apart are scored as if this far.
        inv_freq: ``(F,)`` the layer's rotary frequencies (``2F <= d``).
        q_start: stream position of the first query (default ``Tk - Tq``: the last keys).
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, Tk)`` bool, True for real tokens; padded queries output 0.
        block_size: queries per softmax block.
        split: force (True) or forbid (False) the split form; None picks as above.

    Returns:
        ``(B, Hq, Tq, Dv)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import capped_rope_attention, capped_rope_attention_reference
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
        >>> out = capped_rope_attention(q, k, v, 5, inv_freq, block_size=4)
        >>> out.shape, torch.allclose(out, capped_rope_attention_reference(q, k, v, 5, inv_freq), atol=1e-5)
        (torch.Size([1, 4, 12, 8]), True)
    """
    q_start = _check(q, k, v, distance, q_start)
    B, Hq, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    if split is None:
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        split = q.device.type == "cpu" and not grad and not softcap and _cpu_flash_with_lse() is not None
    kpm = None if key_padding_mask is None else key_padding_mask.bool()
    far_end = q_start + Tq - 1 - distance  # keys j < far_end can be farther than the cap from some query
    k_far = rope_to_origin(k[:, :, :far_end], inv_freq) if far_end > 0 else None
    outs = []
    for s in range(0, Tq, block_size):
        e = min(Tq, s + block_size)
        ts, te = q_start + s, q_start + e - 1  # stream positions of the block's first and last query
        t = torch.arange(ts, te + 1, device=q.device)
        near_lo = max(0, ts - distance)  # keys before this are beyond the cap for every query here
        n_far = max(0, te - distance)  # keys j < n_far are beyond the cap for some query here
        j_near = torch.arange(near_lo, te + 1, device=q.device)
        j_far = torch.arange(n_far, device=q.device)
        near_ok = ((t[:, None] >= j_near[None, :]) & (t[:, None] - j_near[None, :] <= distance))[None]  # (1, Tb, Ln)
        far_ok = ((t[:, None] - j_far[None, :]) > distance)[None]  # (1, Tb, Lf)
        q_valid = None
        if kpm is not None:  # padded keys are never seen; a padded query sees only its own key
            q_valid = kpm[:, ts : te + 1]
            own = (t[:, None] == j_near[None, :])[None] & ~q_valid[:, :, None]
            near_ok = (near_ok & kpm[:, None, near_lo : te + 1]) | own
            far_ok = far_ok & kpm[:, None, :n_far] & q_valid[:, :, None]
        qb = q[:, :, s:e]
        q_far = rope_rotate(qb, (distance - t).view(1, 1, -1), inv_freq) if n_far else None
        parts = (qb, k[:, :, near_lo : te + 1], v[:, :, near_lo : te + 1], near_ok)
        far = (q_far, k_far[:, :, :n_far], v[:, :, :n_far], far_ok) if n_far else None
        if split:
            out = _split_block(parts, far, group, scaling)
        else:
            out = _joint_block(parts, far, group, scaling, softcap)
        if q_valid is not None:
            out = out * q_valid[:, None, :, None].to(out.dtype)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _joint_block(near, far, group: int, scaling: float, softcap: float | None) -> torch.Tensor:
    """One softmax over ``[far | near]`` keys, each pair scored by its own copy (width ``2d``)."""
    qb, k_near, v_near, near_ok = near
    if far is not None:
        q_far, k_far, v_far, far_ok = far
        q_cat = torch.cat([qb, q_far], dim=-1)
        k_cat = torch.cat([torch.cat([torch.zeros_like(k_far), k_far], dim=-1),
                           torch.cat([k_near, torch.zeros_like(k_near)], dim=-1)], dim=2)
        v_cat, allowed = torch.cat([v_far, v_near], dim=2), torch.cat([far_ok, near_ok], dim=-1)
    else:
        q_cat, k_cat, v_cat, allowed = qb, k_near, v_near, near_ok
    if softcap:
        return masked_dense_attention(q_cat, k_cat, v_cat, allowed.expand(q_cat.shape[0], -1, -1),
                                      scaling=scaling, softcap=softcap)
    if group > 1:
        k_cat, v_cat = k_cat.repeat_interleave(group, dim=1), v_cat.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q_cat, k_cat, v_cat, attn_mask=allowed[:, None], scale=scaling)


def _split_block(near, far, group: int, scaling: float) -> torch.Tensor:
    """Near and far keys in two fused softmaxes, merged by their log-sum-exps (no autograd)."""
    flash = _cpu_flash_with_lse()

    def attend(qx, kx, vx, ok):
        B, Hq = qx.shape[:2]
        mask = torch.zeros(ok.shape, dtype=qx.dtype, device=qx.device).masked_fill(~ok, float("-inf"))
        kx = kx[:, :, None].expand(-1, -1, group, -1, -1).reshape(B, Hq, *kx.shape[2:]) if group > 1 else kx
        vx = vx[:, :, None].expand(-1, -1, group, -1, -1).reshape(B, Hq, *vx.shape[2:]) if group > 1 else vx
        return flash(qx, kx, vx, 0.0, False, attn_mask=mask[:, None], scale=scaling)

    o_near, lse_near = attend(*near)
    if far is None:
        return o_near
    seen = far[3].any(-1)  # (B or 1, Tb): a query with no far key keeps the near softmax alone
    ok = far[3] | ~seen[..., None]  # such rows attend somewhere (then get weight 0), never to nothing
    o_far, lse_far = attend(*far[:3], ok)
    w = torch.sigmoid(lse_far - lse_near) * seen[:, None].to(lse_near.dtype)  # (B, Hq, Tb)
    return o_near + w[..., None].to(o_near.dtype) * (o_far - o_near)
