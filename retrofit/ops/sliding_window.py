"""Causal sliding-window softmax attention in O(T * w).

Window convention (same as transformers' ``sliding_window`` and flash-attn's
``window_size=(w - 1, 0)``): query t attends to keys s with ``t - w < s <= t``, i.e. the
last ``w`` tokens *including itself*.

Shapes: q ``(B, Hq, Tq, d)``, k ``(B, Hkv, Tk, d)``, v ``(B, Hkv, Tk, Dv)`` with
``Hq % Hkv == 0`` (grouped-query attention) and ``Tk = num_past + Tq``: the first
``num_past`` keys are cached keys that precede the queries (decoding / chunked prefill).
``key_padding_mask`` ``(B, Tk)`` is True for real tokens. Queries at padded positions
return zeros.

On CPU, unpadded prefill/training calls without soft-capping take a two-pass form on
PyTorch's fused flash kernel (:class:`_TwoPassBlockedSWA`): each query block of ``w`` is a
mask-free causal call against its own key block plus a mask-free causal call against the
reversed previous block, merged by log-sum-exp. It scores ``w`` keys per query (the masked
blocked form scores ``2w``) and never materialises a mask or the scores.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sliding_window_attention", "sliding_window_attention_reference"]

# PyTorch's fused CPU flash-attention kernel, which (unlike F.scaled_dot_product_attention)
# returns the log-sum-exp that merging two partial softmaxes needs. Private ATen ops: when a
# PyTorch build lacks them, the masked blocked form below is used instead.
_FLASH_CPU_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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


class _TwoPassBlockedSWA(torch.autograd.Function):
    """Causal window-``w`` attention for ``T % w == 0`` as two mask-free flash calls per block.

    Query ``i`` of block ``b`` sees keys ``0..i`` of block ``b`` (pass A: plain causal) and keys
    ``j > i`` of block ``b - 1`` (pass B). Reversing both the queries ``0..w-2`` and the keys
    ``1..w-1`` turns ``j > i`` into causal order, so pass B is causal too. The passes are merged
    by their log-sum-exps; the backward calls the flash backward of each pass with the *merged*
    output and log-sum-exp, which yields the gradients of the merged softmax exactly.

    q, k, v: ``(N, n, w, d|D)`` contiguous blocks (N = batch x heads). Returns ``(N, n, w, D)``.
    """

    @staticmethod
    def _pass_b(x: torch.Tensor, queries: bool) -> torch.Tensor:
        # queries 0..w-2 of blocks 1..n-1 / keys 1..w-1 of blocks 0..n-2, reversed within the block
        N, n, w, c = x.shape
        part = x[:, 1:, : w - 1] if queries else x[:, :-1, 1:]
        return part.flip(2).reshape(N * (n - 1), 1, w - 1, c)

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        N, n, w, d = q.shape
        D = v.shape[-1]
        out, lse = _FLASH_CPU_FWD(q.view(N * n, 1, w, d), k.view(N * n, 1, w, d), v.view(N * n, 1, w, D),
                                  is_causal=True, scale=scale)
        out, lse = out.reshape(N, n, w, D), lse.reshape(N, n, w)
        if n > 1 and w > 1:
            pb = _TwoPassBlockedSWA._pass_b
            out_b, lse_b = _FLASH_CPU_FWD(pb(q, True), pb(k, False), pb(v, False), is_causal=True, scale=scale)
            out_b = out_b.reshape(N, n - 1, w - 1, D).flip(2)
            lse_b = lse_b.reshape(N, n - 1, w - 1).flip(2)
            lse_a = lse[:, 1:, : w - 1]
            merged = torch.logaddexp(lse_a, lse_b)
            mixed = (torch.exp(lse_a - merged)[..., None] * out[:, 1:, : w - 1]
                     + torch.exp(lse_b - merged)[..., None] * out_b)
            out[:, 1:, : w - 1] = mixed.to(out.dtype)
            lse[:, 1:, : w - 1] = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        N, n, w, d = q.shape
        D = v.shape[-1]
        grad_out = grad_out.contiguous()
        dq, dk, dv = _FLASH_CPU_BWD(
            grad_out.view(N * n, 1, w, D), q.view(N * n, 1, w, d), k.view(N * n, 1, w, d), v.view(N * n, 1, w, D),
            out.view(N * n, 1, w, D), lse.view(N * n, 1, w), 0.0, True, scale=ctx.scale,
        )
        dq, dk, dv = dq.reshape(N, n, w, d).clone(), dk.reshape(N, n, w, d).clone(), dv.reshape(N, n, w, D).clone()
        if n > 1 and w > 1:
            pb = _TwoPassBlockedSWA._pass_b
            lse_b = lse[:, 1:, : w - 1].flip(2).reshape(N * (n - 1), 1, w - 1)
            dq_b, dk_b, dv_b = _FLASH_CPU_BWD(
                pb(grad_out, True), pb(q, True), pb(k, False), pb(v, False), pb(out, True), lse_b,
                0.0, True, scale=ctx.scale,
            )
            dq[:, 1:, : w - 1] += dq_b.reshape(N, n - 1, w - 1, d).flip(2)
            dk[:, :-1, 1:] += dk_b.reshape(N, n - 1, w - 1, d).flip(2)
            dv[:, :-1, 1:] += dv_b.reshape(N, n - 1, w - 1, D).flip(2)
        return dq, dk, dv, None


def _two_pass_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None,
                      key_padding_mask: torch.Tensor | None, num_past: int) -> bool:
    return (
        _FLASH_CPU_FWD is not None and _FLASH_CPU_BWD is not None
        and q.device.type == "cpu" and q.dtype in _FLASH_CPU_DTYPES and q.dtype == k.dtype == v.dtype
        and q.shape[-1] == v.shape[-1]  # the kernel wants one head size for q, k and v
        and (softcap is None or softcap <= 0) and key_padding_mask is None and num_past == 0
    )


def _two_pass_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scaling: float) -> torch.Tensor:
    """``(B, Hq, T, d)`` queries, ``(B, Hkv, T, .)`` keys/values -> ``(B, Hq, T, D)`` via :class:`_TwoPassBlockedSWA`."""
    B, Hq, T, d = q.shape
    Hkv, D, w = k.shape[1], v.shape[-1], window
    if Hkv != Hq:  # the flash kernel wants equal heads; autograd sums the copies' gradients
        k = k[:, :, None].expand(B, Hkv, Hq // Hkv, T, d).reshape(B, Hq, T, d)
        v = v[:, :, None].expand(B, Hkv, Hq // Hkv, T, D).reshape(B, Hq, T, D)
    n = -(-T // w)
    tail = n * w - T  # zero rows at the end: only padded queries can see padded keys (causal)
    blocks = [F.pad(x, (0, 0, 0, tail)).reshape(B * Hq, n, w, x.shape[-1]).contiguous() for x in (q, k, v)]
    out = _TwoPassBlockedSWA.apply(*blocks, scaling)
    return out.reshape(B, Hq, n * w, D)[:, :, :T]


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
    soft-capping is requested, which SDPA cannot express. On CPU without padding, cached keys
    or soft-capping, the two-pass flash form (O(Tq * w * d), no mask) runs instead.
    Returns ``(B, Hq, Tq, Dv)``.
    """
    B, Hq, Tq, d = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if Tk != num_past + Tq:
        raise ValueError(f"keys ({Tk}) must be num_past ({num_past}) + queries ({Tq})")
    if num_past > window:  # only the last w-1 past keys can be seen; drop the rest
        drop = num_past - window
        k, v = k[:, :, drop:], v[:, :, drop:]
        key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, drop:]
        num_past, Tk = window, window + Tq
    if Tq <= window:
        return sliding_window_attention_reference(
            q, k, v, window, scaling=scaling, softcap=softcap,
            key_padding_mask=key_padding_mask, num_past=num_past,
        )
    w, group = window, Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    if key_padding_mask is not None and q.device.type == "cpu" and bool(key_padding_mask.all()):
        key_padding_mask = None  # nothing padded: the mask-free forms apply
    if _two_pass_applies(q, k, v, softcap, key_padding_mask, num_past):
        return _two_pass_blocked(q, k, v, window, scaling)
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
