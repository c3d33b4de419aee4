"""Causal sliding-window softmax attention in O(T * w).

Window convention (same as transformers' ``sliding_window`` and flash-attn's
``window_size=(w - 1, 0)``): query t attends to keys s with ``t - w < s <= t``, i.e. the
last ``w`` tokens *including itself*.

Shapes: q ``(B, Hq, Tq, d)``, k ``(B, Hkv, Tk, d)``, v ``(B, Hkv, Tk, Dv)`` with
``Hq % Hkv == 0`` (grouped-query attention) and ``Tk = num_past + Tq``: the first
``num_past`` keys are cached keys that precede the queries (decoding / chunked prefill).
``key_padding_mask`` ``(B, Tk)`` is True for real tokens. Queries at padded positions
return zeros.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sliding_window_attention", "sliding_window_attention_reference"]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 scores go to fp32 for the softmax; fp32/fp64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None or softcap <= 0:
        return scores
    return torch.tanh(scores / softcap) * softcap


def sliding_window_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
) -> torch.Tensor:
    """Dense masked form, O(Tq * Tk): the reference, and the fast path for short query blocks."""
    B, Hq, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Tk != num_past + Tq:
        raise ValueError(f"keys ({Tk}) must be num_past ({num_past}) + queries ({Tq})")
    group = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    qg = q.reshape(B, Hkv, group * Tq, d)
    scores = _upcast(torch.matmul(qg, k.transpose(-1, -2))) * scaling
    scores = _softcap(scores, softcap).view(B, Hkv, group, Tq, Tk)

    q_pos = torch.arange(Tq, device=q.device)[:, None] + num_past
    k_pos = torch.arange(Tk, device=q.device)[None, :]
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)  # (Tq, Tk)
    allowed = allowed.view(1, 1, 1, Tq, Tk)
    q_valid = None
    if key_padding_mask is not None:
        kv_valid = key_padding_mask.view(B, 1, 1, 1, Tk).bool()
        q_valid = key_padding_mask[:, num_past:].view(B, 1, 1, Tq, 1).bool()
        # a padded query sees its own key only, so its row never is all -inf; zeroed below
        self_key = k_pos == q_pos
        allowed = (allowed & kv_valid) | (~q_valid & self_key.view(1, 1, 1, Tq, Tk))
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs.view(B, Hkv, group * Tq, Tk), v).view(B, Hq, Tq, -1)
    if q_valid is not None:
        out = out * q_valid.view(B, 1, Tq, 1).to(out.dtype)
    return out


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
) -> torch.Tensor:
    """Blocked form: queries in blocks of ``w`` attend to their own and the previous key block.

    Cost O(Tq * 2w * d) time and memory; uses SDPA (fused on CPU and GPU) unless logit
    soft-capping is requested, which SDPA cannot express. Returns ``(B, Hq, Tq, Dv)``.
    """
    B, Hq, Tq, d = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if Tk != num_past + Tq:
        raise ValueError(f"keys ({Tk}) must be num_past ({num_past}) + queries ({Tq})")
    if num_past > window:  # only the last w-1 past keys can be seen; drop the rest
        drop = num_past - window
        k, v = k[:, :, drop:], v[:, :, drop:]
        key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, drop:]
        num_past = window
    if Tq <= window:
        return sliding_window_attention_reference(
            q, k, v, window, scaling=scaling, softcap=softcap,
            key_padding_mask=key_padding_mask, num_past=num_past,
        )
    w, group = window, Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    n = -(-Tq // w)
    tail = n * w - Tq
    # key index j (queries at 0..Tq-1, past keys at -num_past..-1) lives at j + w in kp
    front = w - num_past
    kp = F.pad(k, (0, 0, front, tail))
    vp = F.pad(v, (0, 0, front, tail))
    valid = torch.ones(B, Tk, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask.bool()
    valid = F.pad(valid, (front, tail), value=False)  # (B, (n+1) w)

    def two_blocks(x: torch.Tensor) -> torch.Tensor:  # (..., (n+1) w, c) -> (..., n, 2w, c)
        prev = x[..., : n * w, :].unflatten(-2, (n, w))
        cur = x[..., w:, :].unflatten(-2, (n, w))
        return torch.cat([prev, cur], dim=-2)

    kb, vb = two_blocks(kp), two_blocks(vp)  # (B, Hkv, n, 2w, .)
    vmask = two_blocks(valid.unsqueeze(-1)).squeeze(-1)  # (B, n, 2w)
    qp = F.pad(q, (0, 0, 0, tail)).view(B, Hkv, group, n, w, d)
    qb = qp.permute(0, 1, 3, 2, 4, 5).reshape(B, Hkv, n, group * w, d)

    a = torch.arange(w, device=q.device)
    band = torch.cat([a[None, :] > a[:, None], a[None, :] <= a[:, None]], dim=1)  # (w, 2w)
    diag = torch.cat([torch.zeros(w, w, dtype=torch.bool, device=q.device), torch.eye(w, dtype=torch.bool, device=q.device)], dim=1)
    q_valid = valid[:, w:].view(B, n, w)  # query i lives at kp index i + w
    allowed = (band & vmask[:, :, None, :]) | (~q_valid[..., None] & diag)  # (B, n, w, 2w)
    allowed = allowed.unsqueeze(2).expand(B, n, group, w, 2 * w).reshape(B, 1, n, group * w, 2 * w)

    if softcap is None or softcap <= 0:
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scaling)
    else:
        scores = _softcap(_upcast(torch.matmul(qb, kb.transpose(-1, -2))) * scaling, softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), vb)
    out = out.view(B, Hkv, n, group, w, Dv).permute(0, 1, 3, 2, 4, 5).reshape(B, Hq, n * w, Dv)[:, :, :Tq]
    if key_padding_mask is not None:
        out = out * q_valid.reshape(B, 1, n * w, 1)[:, :, :Tq].to(out.dtype)
    return out
