"""Causal sliding-window softmax attention in O(T * w).

Window convention (same as transformers' ``sliding_window`` and flash-attn's
``window_size=(w - 1, 0)``): query t attends to keys s with ``t - w < s <= t``, i.e. the
last ``w`` tokens *including itself*.

Shapes: q ``(B, Hq, Tq, d)``, k ``(B, Hkv, Tk, d)``, v ``(B, Hkv, Tk, Dv)`` with
``Hq % Hkv == 0`` (grouped-query attention) and ``Tk = num_past + Tq``: the first
``num_past`` keys are cached keys that precede the queries (decoding / chunked prefill).
``key_padding_mask`` ``(B, Tk)`` is True for real tokens. Queries at padded positions
return zeros.

On CPU the blocked form runs as :class:`_BandedSWA`: per head, each query block of ``w``
scores its previous and own key blocks through an *overlapping strided view* of the keys
(no copies of k or v), softmax and value product as batched GEMMs, and a hand-written
backward (fused softmax backward, key/value gradients accumulated straight into their
blocks). Elsewhere (CUDA without flash-attn, MPS) the blocked form goes through SDPA with a
boolean mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sliding_window_attention", "sliding_window_attention_reference", "sliding_window_lse"]



def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 scores go to fp32 for the softmax; fp32/fp64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None or softcap <= 0:
        return scores
    return torch.tanh(scores / softcap) * softcap


def _dense_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    window: int,
    scaling: float | None,
    softcap: float | None,
    key_padding_mask: torch.Tensor | None,
    num_past: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Window-masked scores ``(B, Hkv, group, Tq, Tk)`` (-inf outside; fp32 or wider) and the query
    validity ``(B, 1, 1, Tq, 1)`` (None without padding). A padded query sees only its own key, so
    no row is all -inf."""
    B, Hq, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
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
        self_key = k_pos == q_pos
        allowed = (allowed & kv_valid) | (~q_valid & self_key.view(1, 1, 1, Tq, Tk))
    return scores.masked_fill(~allowed, float("-inf")), q_valid


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
    scores, q_valid = _dense_scores(q, k, window, scaling, softcap, key_padding_mask, num_past)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs.view(B, Hkv, (Hq // Hkv) * Tq, Tk), v).view(B, Hq, Tq, -1)
    if q_valid is not None:
        out = out * q_valid.view(B, 1, Tq, 1).to(out.dtype)
    return out


def _windows(x: torch.Tensor, window: int, num_past: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key windows of one head: ``x`` ``(num_past + blocks * w, c)`` contiguous.

    Returns ``(first (2w, c), rest (blocks - 1, 2w, c))``: window ``c`` holds the ``w`` keys before
    query block ``c`` and its own ``w`` keys. ``rest`` is an overlapping strided view of ``x`` (no
    copy); ``first`` is zero-padded in front (its missing keys are masked).
    """
    w, c = window, x.shape[-1]
    first = F.pad(x[: num_past + w], (0, 0, w - num_past, 0))
    rest = x[num_past:].as_strided((blocks - 1, 2 * w, c), (w * c, c, 1))
    return first, rest


class _BandedSWA(torch.autograd.Function):
    """Blocked sliding-window attention as per-head batched GEMMs over overlapping key windows.

    q ``(B, Hq, n w, d)``; k, v ``(B, Hkv, num_past + n w, d|D)`` (all contiguous, ``num_past
    <= w``); allowed ``(B|1, 1, n, w, 2w)`` bool over each query block's window (see
    :func:`_windows`). Returns ``(B, Hq, n w, D)``. Scores of a head are ``(n, w, 2w)``: O(T w)
    time and memory, and k, v are never copied.
    """

    @staticmethod
    def forward(ctx, q, k, v, allowed, window: int, num_past: int, scale: float, softcap: float | None):
        B, Hq, Tq, d = q.shape
        w, n, group = window, Tq // window, Hq // k.shape[1]
        probs = q.new_empty(B, Hq, n, w, 2 * w)
        for b in range(B):
            for h in range(Hq):
                k0, kw = _windows(k[b, h // group], w, num_past, n)
                qb, s = q[b, h].view(n, w, d), probs[b, h]
                torch.mm(qb[0], k0.t(), out=s[0]).mul_(scale)
                s[1:].baddbmm_(qb[1:], kw.transpose(1, 2), beta=0.0, alpha=scale)
        tanh = None
        if softcap is not None:
            tanh = torch.tanh(probs / softcap)
            probs = torch.mul(tanh, softcap, out=probs)
        probs.masked_fill_(~allowed, float("-inf"))
        probs = torch.softmax(probs, dim=-1)
        out = q.new_empty(B, Hq, Tq, v.shape[-1])
        for b in range(B):
            for h in range(Hq):
                v0, vw = _windows(v[b, h // group], w, num_past, n)
                p, o = probs[b, h], out[b, h].view(n, w, -1)
                torch.mm(p[0], v0, out=o[0])
                torch.bmm(p[1:], vw, out=o[1:])
        ctx.save_for_backward(q, k, v, probs, tanh)
        ctx.cfg = (w, num_past, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, probs, tanh = ctx.saved_tensors
        w, num_past, scale = ctx.cfg
        B, Hq, Tq, d = q.shape
        n, group = Tq // w, Hq // k.shape[1]
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for b in range(B):
            for h in range(Hq):
                hk = h // group
                k0, kw = _windows(k[b, hk], w, num_past, n)
                v0, vw = _windows(v[b, hk], w, num_past, n)
                do, p, qb = grad_out[b, h].view(n, w, -1), probs[b, h], q[b, h].view(n, w, d)
                dp = torch.empty_like(p)
                torch.mm(do[0], v0.t(), out=dp[0])
                torch.bmm(do[1:], vw.transpose(1, 2), out=dp[1:])
                ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
                if tanh is not None:
                    ds.mul_(1.0 - tanh[b, h].square())
                dqb = dq[b, h].view(n, w, d)
                torch.mm(ds[0], k0, out=dqb[0]).mul_(scale)
                dqb[1:].baddbmm_(ds[1:], kw, beta=0.0, alpha=scale)
                # window c = [the w keys before block c | block c's own keys]
                beta = 0.0 if h % group == 0 else 1.0  # first query head of a KV group overwrites
                for grad, weights, rhs, alpha in ((dk, ds, qb, scale), (dv, p, do, 1.0)):
                    g = grad[b, hk]
                    own = g[num_past:].view(n, w, -1)
                    if beta == 0.0:
                        g[:num_past].zero_()
                    own.baddbmm_(weights[..., w:].transpose(1, 2), rhs, beta=beta, alpha=alpha)
                    own[:-1].baddbmm_(weights[1:, :, :w].transpose(1, 2), rhs[1:], alpha=alpha)
                    if num_past:  # block 0's earlier keys are the cached ones
                        g[:num_past].addmm_(weights[0, :, w - num_past: w].t(), rhs[0], alpha=alpha)
        return dq, dk, dv, None, None, None, None, None


def _window_mask(
    key_padding_mask: torch.Tensor | None, num_keys: int, window: int, blocks: int, num_past: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys each query block may see, in the blocked layout of both forms below.

    Keys are front-padded so query 0 sits at padded index ``w`` (``w - num_past`` padding
    keys, then the cached and the new keys, then the tail up to ``blocks * w`` queries); query
    block ``c`` scores padded key blocks ``c`` and ``c + 1``. Returns ``allowed (B|1, n, w, 2w)``
    and ``q_valid (B|1, n, w)``. Padded queries (and the tail) keep their own key, so no row
    is all -inf; the callers zero their outputs.
    """
    w, n = window, blocks
    valid = (torch.ones(1, num_keys, dtype=torch.bool, device=device) if key_padding_mask is None
             else key_padding_mask.bool())
    valid = F.pad(valid, (w - num_past, n * w + num_past - num_keys), value=False)  # (B|1, (n + 1) w)
    i = torch.arange(w, device=device)[:, None]
    r = torch.arange(2 * w, device=device)[None, :]
    band = (r > i) & (r <= i + w)  # query i of a block sees window keys i+1 .. i+w
    q_valid = valid[:, w:].view(-1, n, w)
    allowed = (band & valid.unfold(1, 2 * w, w)[:, :, None, :]) | (~q_valid[..., None] & (r == i + w))
    return allowed, q_valid


def _block_layout(
    q: torch.Tensor, kv: tuple[torch.Tensor, ...], window: int, num_past: int, key_padding_mask: torch.Tensor | None,
):
    """The blocked layout shared by the SDPA form and :func:`sliding_window_lse`.

    Queries ``(B, Hq, Tq, d)`` -> ``(B, Hkv, n, group w, d)`` (query heads of a GQA group stacked
    per block); each key-like tensor ``(B, Hkv, num_past + Tq, c)`` -> ``(B, Hkv, n, 2w, c)``
    (the previous and the own key block of each query block); ``allowed`` ``(B|1, 1, n, group w,
    2w)``, ``q_valid`` ``(B|1, n, w)`` from :func:`_window_mask`; ``n`` query blocks.
    """
    B, Hq, Tq, d = q.shape
    Hkv, Tk = kv[0].shape[1], kv[0].shape[2]
    w, group = window, Hq // Hkv
    n = -(-Tq // w)
    tail = n * w - Tq

    def two_blocks(x: torch.Tensor) -> torch.Tensor:  # key j (past keys at -num_past..-1) sits at j + w
        x = F.pad(x, (0, 0, w - num_past, tail))
        return torch.cat([x[..., : n * w, :].unflatten(-2, (n, w)), x[..., w:, :].unflatten(-2, (n, w))], dim=-2)

    qb = F.pad(q, (0, 0, 0, tail)).view(B, Hkv, group, n, w, d).permute(0, 1, 3, 2, 4, 5).reshape(B, Hkv, n, group * w, d)
    allowed, q_valid = _window_mask(key_padding_mask, Tk, w, n, num_past, q.device)
    Bm = allowed.shape[0]
    allowed = allowed.unsqueeze(2).expand(Bm, n, group, w, 2 * w).reshape(Bm, 1, n, group * w, 2 * w)
    return qb, tuple(two_blocks(x) for x in kv), allowed, q_valid, n


def _banded_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scaling: float,
    softcap: float | None,
    key_padding_mask: torch.Tensor | None,
    num_past: int,
) -> torch.Tensor:
    """The blocked form through :class:`_BandedSWA`; ``num_past <= window``. Returns ``(B, Hq, Tq, Dv)``."""
    B, Hq, Tq, d = q.shape
    Tk, w = k.shape[2], window
    compute = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 inputs: fp32 GEMMs and softmax
    n = -(-Tq // w)
    tail = n * w - Tq

    def prepared(x: torch.Tensor) -> torch.Tensor:  # no copy when already fine
        x = x.to(compute)
        return (F.pad(x, (0, 0, 0, tail)) if tail else x).contiguous()

    allowed, q_valid = _window_mask(key_padding_mask, Tk, w, n, num_past, q.device)
    out = _BandedSWA.apply(prepared(q), prepared(k), prepared(v), allowed[:, None], w, num_past, scaling, softcap)
    out = out[:, :, :Tq] if tail else out
    if key_padding_mask is not None:
        out = out * q_valid.reshape(-1, 1, n * w, 1)[:, :, :Tq].to(out.dtype)
    return out.to(v.dtype)


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
    soft-capping is requested, which SDPA cannot express. On CPU the same blocks run as
    :class:`_BandedSWA` (no k/v copies, no mask expansion over heads, own backward).
    Returns ``(B, Hq, Tq, Dv)``.
    """
    B, Hq, Tq, d = q.shape
    Tk = k.shape[2]
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
    scaling = d**-0.5 if scaling is None else scaling
    softcap = softcap if softcap is not None and softcap > 0 else None
    blocked = _banded_blocked if q.device.type == "cpu" else _masked_blocked
    return blocked(q, k, v, window, scaling, softcap, key_padding_mask, num_past)


def _masked_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scaling: float,
    softcap: float | None,
    key_padding_mask: torch.Tensor | None,
    num_past: int,
) -> torch.Tensor:
    """The blocked form through SDPA with a boolean (B, n, w, 2w) mask (GPU without flash-attn)."""
    B, Hq, Tq, d = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    w, group = window, Hq // Hkv
    qb, (kb, vb), allowed, q_valid, n = _block_layout(q, (k, v), window, num_past, key_padding_mask)

    if softcap is None:
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scaling)
    else:
        scores = _softcap(_upcast(torch.matmul(qb, kb.transpose(-1, -2))) * scaling, softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), vb)
    out = out.view(B, Hkv, n, group, w, Dv).permute(0, 1, 3, 2, 4, 5).reshape(B, Hq, n * w, Dv)[:, :, :Tq]
    if key_padding_mask is not None:
        out = out * q_valid.reshape(-1, 1, n * w, 1)[:, :, :Tq].to(out.dtype)
    return out


def sliding_window_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    window: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
) -> torch.Tensor:
    """``(B, Hq, Tq)`` log-sum-exp (fp32 or wider) of each query's window scores (same window and masks as
    :func:`sliding_window_attention`), in the same blocked O(T w) layout; differentiable.

    Used to merge the window softmax with other keys (attention sinks) into one softmax.
    """
    B, Hq, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Tk != num_past + Tq:
        raise ValueError(f"keys ({Tk}) must be num_past ({num_past}) + queries ({Tq})")
    if num_past > window:
        drop = num_past - window
        k = k[:, :, drop:]
        key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, drop:]
        num_past, Tk = window, window + Tq
    if Tq <= window:  # short query blocks (decoding, short sequences): dense over <= 2w keys, no w-padding
        scores, _ = _dense_scores(q, k, window, scaling, softcap, key_padding_mask, num_past)
        return torch.logsumexp(scores, dim=-1).view(B, Hq, Tq)
    scaling = d**-0.5 if scaling is None else scaling
    w, group = window, Hq // Hkv
    qb, (kb,), allowed, _, n = _block_layout(q, (k,), window, num_past, key_padding_mask)
    scores = _softcap(_upcast(torch.matmul(qb, kb.transpose(-1, -2))) * scaling, softcap)
    lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # (B, Hkv, n, group w)
    return lse.view(B, Hkv, n, group, w).permute(0, 1, 3, 2, 4).reshape(B, Hq, n * w)[:, :, :Tq]
