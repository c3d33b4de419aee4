"""Causal sliding-window softmax attention in O(T * w).

Window convention (same as transformers' ``sliding_window`` and flash-attn's
``window_size=(w - 1, 0)``): query t attends to keys s with ``t - w < s <= t``, i.e. the
last ``w`` tokens *including itself*.

Shapes: q ``(B, Hq, Tq, d)``, k ``(B, Hkv, Tk, d)``, v ``(B, Hkv, Tk, Dv)`` with
``Hq % Hkv == 0`` (grouped-query attention) and ``Tk = num_past + Tq``: the first
``num_past`` keys are cached keys that precede the queries (decoding / chunked prefill).
``key_padding_mask`` ``(B, Tk)`` is True for real tokens. Queries at padded positions
return zeros.

On CPU the blocked form runs as :class:`_BandedSWA`: per head, each block of ``b`` queries
(:func:`_query_block`, a divisor of ``w``) scores the ``w + b`` keys that end with its own,
through an *overlapping strided view* of the keys (no copies of k or v), softmax and value
product as batched GEMMs, and a hand-written backward (fused softmax backward, key/value
gradients accumulated straight into their blocks); it can also return each query's window
log-sum-exp from the same pass. Without autograd, PyTorch's fused CPU attention kernel (which
returns the log-sum-exp with its output) takes every call of at most ``w`` queries, and with heads
of at most :data:`FUSED_MAX_HEAD_DIM` every call (:func:`_fused_form`): without padding, each block
of ``w`` queries in unmasked calls over key sets whose visibility is causal or total, merged by
their log-sum-exps (:func:`_fused_band`); with padding, all keys at once masked to each query's
window, up to ``2w`` keys, else block by block. Elsewhere (CUDA without flash-attn,
MPS) the blocked form goes through SDPA with a boolean mask over blocks of ``w`` queries and ``2w``
keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from retrofit.ops._common import (
    check_num_past, from_blocks, grouped_attend, grouped_scores, query_blocks, soft_cap, two_blocks, upcast,
    window_keys,
)

__all__ = [
    "sliding_window_attention",
    "sliding_window_attention_reference",
    "sliding_window_attention_with_lse",
    "sliding_window_lse",
]


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
    scores = grouped_scores(q, k, scaling, softcap)
    allowed, q_valid = dense_window_mask(q.shape[2], k.shape[2], window, key_padding_mask, num_past, q.device)
    return scores.masked_fill(~allowed[:, None], float("-inf")), None if q_valid is None else q_valid[:, None]


def dense_window_mask(
    Tq: int, Tk: int, window: int, key_padding_mask: torch.Tensor | None, num_past: int, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which keys each query sees, ``(B|1, 1, Tq, Tk)`` bool, and the query validity ``(B, 1, Tq, 1)``
    (None without padding). A padded query sees only its own key, so no row is all -inf."""
    q_pos = torch.arange(Tq, device=device)[:, None] + num_past
    k_pos = torch.arange(Tk, device=device)[None, :]
    allowed = ((k_pos <= q_pos) & (k_pos > q_pos - window)).view(1, 1, Tq, Tk)
    if key_padding_mask is None:
        return allowed, None
    B = key_padding_mask.shape[0]
    q_valid = key_padding_mask[:, num_past:].view(B, 1, Tq, 1).bool()
    self_key = (k_pos == q_pos).view(1, 1, Tq, Tk)
    return (allowed & key_padding_mask.view(B, 1, 1, Tk).bool()) | (~q_valid & self_key), q_valid


# PyTorch's fused CPU attention (flash form) returns each query's log-sum-exp beside its output; it
# is an internal op, so it is looked up once and the other forms serve where it is missing
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

# Without autograd the fused kernel runs wherever it was measured faster than the other CPU forms
# (2-vCPU Zen 4 host, fp32): every call of at most w queries (one 1024-token call of 9 heads of 64
# at w 1024: 17 ms against 71 ms for the dense form, `retrofit bench attention --ops swa`), and
# longer calls only with heads of at most this dimension. 4096-query calls,
# scripts/research/time_window_forms.py: at d 64 it takes 0.53-0.82x the banded form's time (w 512-
# 2048); at d 256 the banded form's thicker GEMMs win (the fused kernel 1.07-1.48x block by block,
# 1.15x with all 2w keys at once).
FUSED_MAX_HEAD_DIM = 128


def _fused_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None) -> bool:
    """Whether the fused CPU kernel can run this call: the op exists, a CPU tensor of fp32 / bf16 /
    fp16, no soft-capping (it has none), and no autograd (its log-sum-exp carries no gradient)."""
    return (_FUSED_CPU is not None and q.device.type == "cpu" and not (softcap is not None and softcap > 0)
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))))


def _fused_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scaling: float | None,
    softcap: float | None,
    key_padding_mask: torch.Tensor | None,
    num_past: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, lse)`` from the fused CPU kernel where it serves and wins (:data:`FUSED_MAX_HEAD_DIM`),
    else None. ``k``, ``v`` hold at most ``w`` cached keys (:func:`~retrofit.ops._common.drop_unseen_past`)."""
    Tq, d = q.shape[2], q.shape[3]
    if not _fused_serves(q, k, v, softcap) or (Tq > window and d > FUSED_MAX_HEAD_DIM):
        return None
    if key_padding_mask is not None and bool(key_padding_mask.all()):
        key_padding_mask = None  # no padding after all (a cache passes its validity): the unmasked forms serve
    if key_padding_mask is None and Tq >= BAND_MIN_QUERIES:
        return _fused_band(q, k, v, window, d**-0.5 if scaling is None else scaling, num_past)
    if num_past + Tq <= 2 * window:
        return _fused_dense(q, k, v, window, scaling, key_padding_mask, num_past)
    return _fused_blocked(q, k, v, window, d**-0.5 if scaling is None else scaling, key_padding_mask, num_past)


# Calls of at least this many queries without padding take :func:`_fused_band` (unmasked kernel calls
# only); fewer, one masked call over all their keys costs less than the band's three calls and merge
BAND_MIN_QUERIES = 64


def _merge_partial(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax from softmaxes over disjoint key sets: ``[(out (..., T, D), lse (..., T))]`` ->
    ``(out, lse)``, each part weighted by ``exp(lse_i - lse)`` (an ``lse`` of -inf: no keys)."""
    lse = torch.logsumexp(torch.stack([x for _, x in parts]), dim=0)
    out = None
    for o, x in parts:  # summed in fp32 at least
        term = upcast(o) * torch.exp(x - lse)[..., None]
        out = term if out is None else out + term
    return out.to(parts[0][0].dtype), lse


def _fused_band(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scaling: float,
    num_past: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window through the fused CPU kernel without a mask (callers check :func:`_fused_serves`; no
    padding; ``num_past <= w``): ``(out (B, Hq, Tq, Dv), lse (B, Hq, Tq) fp32)``.

    A masked call scores every key it is given, at about twice the cost per score of an unmasked one
    (and a causal call skips its upper half). So each block of ``w`` queries, local row ``j`` (stream
    position ``c w + j``), is split into key sets that need no mask: its own keys, causal; the
    previous block's keys ``p >= n`` (``n`` the block's rows), seen by every row; and the previous
    block's keys ``p < n``, which row ``j`` sees for ``p > j``: with rows and keys both reversed that
    is causal too. The parts merge by their log-sum-exps (:func:`_merge_partial`).
    """
    B, Hq, Tq, d = q.shape
    group = Hq // k.shape[1]
    v_dtype, v = v.dtype, v.to(q.dtype)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    w, P = window, num_past
    neg_inf = float("-inf")

    def call(qq, kk, vv, causal):
        out, lse = _FUSED_CPU(qq, kk, vv, 0.0, causal, scale=scaling)
        return out, lse.float()

    outs, lses = [], []
    for start in range(0, Tq, w):
        n = min(w, Tq - start)
        qb = q[:, :, start : start + n]
        own = P + start  # key index of the block's first own key
        parts = [call(qb, k[:, :, own : own + n], v[:, :, own : own + n], True)]
        p0 = w - min(own, w)  # previous-block slots p < p0 hold no key (before the stream)
        base = own - w  # key index of slot p is base + p
        lo = max(p0, n)
        if lo < w:  # slots every row sees
            parts.append(call(qb, k[:, :, base + lo : own], v[:, :, base + lo : own], False))
        lo = max(p0, 1)
        if n >= 2 and lo <= n - 1:  # slots lo .. n - 1, row j sees p > j: reversed, causal (rows 0 .. n - 2)
            o, x = call(qb[:, :, : n - 1].flip(2), k[:, :, base + lo : base + n].flip(2),
                        v[:, :, base + lo : base + n].flip(2), True)
            parts.append((F.pad(o.flip(2), (0, 0, 0, 1)), F.pad(x.flip(2), (0, 1), value=neg_inf)))
        out, lse = _merge_partial(parts) if len(parts) > 1 else parts[0]
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2).to(v_dtype), torch.cat(lses, dim=2)


def _fused_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scaling: float | None,
    key_padding_mask: torch.Tensor | None,
    num_past: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every key of the call scored, masked to each query's window, in one fused CPU kernel (callers
    check :func:`_fused_serves`): ``(out (B, Hq, Tq, Dv), lse (B, Hq, Tq) fp32)``.

    It replaces the masked fp32 scores, softmax and value product of
    :func:`sliding_window_attention_reference` (and, beside sinks, a second pass for the
    log-sum-exp): 1024 queries of 9 heads of 64 at w 1024 on 2 Zen 4 cores, 17 ms against 71 ms for
    the output alone (BENCHMARKS.md, "Whole-model speed").
    """
    B, Hq, Tq, d = q.shape
    group = Hq // k.shape[1]
    allowed, q_valid = dense_window_mask(Tq, k.shape[2], window, key_padding_mask, num_past, q.device)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = d**-0.5 if scaling is None else scaling
    out, lse = _FUSED_CPU(q, k, v.to(q.dtype), 0.0, False, attn_mask=bias.expand(B, Hq, Tq, k.shape[2]), scale=scale)
    if q_valid is not None:
        out = out * q_valid.to(out.dtype)
    return out.to(v.dtype), lse.float()


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
    """Dense masked form, O(Tq * Tk): the reference, and the fast path for short query blocks.

    Args:
        q, k, v, window, scaling, softcap, key_padding_mask, num_past: as :func:`sliding_window_attention`.

    Returns:
        ``(B, Hq, Tq, Dv)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import sliding_window_attention_reference
        >>> q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
        >>> sliding_window_attention_reference(q, k, v, 4).shape
        torch.Size([1, 4, 10, 8])
    """
    B, Tq = q.shape[0], q.shape[2]
    check_num_past(q, k, num_past)
    scores, q_valid = _dense_scores(q, k, window, scaling, softcap, key_padding_mask, num_past)
    out = grouped_attend(scores, v)
    if q_valid is not None:
        out = out * q_valid.view(B, 1, Tq, 1).to(out.dtype)
    return out


# Largest query block of the banded form. A block of b queries scores a span of w + b keys, of which
# each query uses w: smaller blocks waste less GEMM work, larger ones make thicker GEMMs. On the
# 2-vCPU Zen 4 host (BENCHMARKS.md) b = 32 beat w / 2 = 64 by 5-10% at w = 128, and b = 64 beat
# w / 2 by 20-40% at w = 512 and 2048, where 32 tied (512) or lost (2048) to 64.
MAX_QUERY_BLOCK = 64


NO_GRAD_SCORE_BYTES = 64 << 20  # without autograd, scores of at most this many bytes exist at once


def _query_block(window: int) -> int:
    """Query block size of the banded form: the largest divisor of ``w`` in
    ``[16, min(MAX_QUERY_BLOCK, w / 4)]``; without one, ``w / 2`` for even ``w >= 32``, else ``w``."""
    for b in range(min(MAX_QUERY_BLOCK, window // 4), 15, -1):
        if window % b == 0:
            return b
    return window // 2 if window % 2 == 0 and window >= 32 else window


def _windows(
    x: torch.Tensor, window: int, block: int, num_past: int, blocks: int
) -> tuple[tuple[slice, torch.Tensor], tuple[slice, torch.Tensor]]:
    """Key windows of one head: ``x`` ``(num_past + blocks * b, c)`` contiguous.

    Window ``j`` holds the ``w + b`` keys ending with query block ``j``'s own ``b`` keys. Returns
    ``((head blocks, head (m, w + b, c)), (rest blocks, rest (blocks - m, w + b, c)))``, each with
    the slice of query blocks it serves: the first ``m`` windows reach before the first key and are
    a zero-padded copy (their missing keys are masked); ``rest`` is an overlapping strided view of
    ``x`` (no copy).
    """
    w, b, c = window, block, x.shape[-1]
    front = w - num_past  # zero keys before x in the padded coordinates (window j starts at j b)
    m = min(blocks, -(-front // b))
    padded = F.pad(x[: max(0, (m - 1) * b + w + b - front)], (0, 0, front, 0)) if m else x.new_zeros(0, c)
    head = padded.as_strided((m, w + b, c), (b * c, c, 1))
    rest = x[m * b - front:].as_strided((blocks - m, w + b, c), (b * c, c, 1))
    return (slice(0, m), head), (slice(m, blocks), rest)


class _BandedSWA(torch.autograd.Function):
    """Blocked sliding-window attention as per-head batched GEMMs over overlapping key windows.

    q ``(B, Hq, n b, d)``; k, v ``(B, Hkv, num_past + n b, d|D)`` (all contiguous, ``num_past
    <= w``, ``b`` divides ``w``); allowed ``(B|1, 1, n, b, w + b)`` bool over each query block's
    window (see :func:`_windows`). Returns ``(B, Hq, n b, D)``. Scores of a head are
    ``(n, b, w + b)``: O(T w) time and memory, and k, v are never copied.
    """

    @staticmethod
    def forward(ctx, q, k, v, allowed, window: int, block: int, num_past: int, scale: float, softcap: float | None,
                with_lse: bool = False):
        B, Hq, Tq, d = q.shape
        w, b, group = window, block, Hq // k.shape[1]
        n = Tq // b
        probs = q.new_empty(B, Hq, n, b, w + b)
        for bi in range(B):
            for h in range(Hq):
                qb, s = q[bi, h].view(n, b, d), probs[bi, h]
                for sl, kw in _windows(k[bi, h // group], w, b, num_past, n):
                    s[sl].baddbmm_(qb[sl], kw.transpose(1, 2), beta=0.0, alpha=scale)
        tanh = None
        if softcap is not None:
            tanh = torch.tanh(probs / softcap)
            probs = torch.mul(tanh, softcap, out=probs)
        probs.masked_fill_(~allowed, float("-inf"))
        # the log-normaliser of each query's window (a sink merge needs it): one pass over the scores
        lse = torch.logsumexp(probs, dim=-1).view(B, Hq, Tq) if with_lse else q.new_empty(0)
        probs = torch.softmax(probs, dim=-1)
        out = q.new_empty(B, Hq, Tq, v.shape[-1])
        for bi in range(B):
            for h in range(Hq):
                p, o = probs[bi, h], out[bi, h].view(n, b, -1)
                for sl, vw in _windows(v[bi, h // group], w, b, num_past, n):
                    torch.bmm(p[sl], vw, out=o[sl])
        ctx.save_for_backward(q, k, v, probs, tanh)
        ctx.cfg = (w, b, num_past, scale)
        if not with_lse:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):
        q, k, v, probs, tanh = ctx.saved_tensors
        w, b, num_past, scale = ctx.cfg
        B, Hq, Tq, d = q.shape
        n, group, spans = Tq // b, Hq // k.shape[1], w // b + 1
        front = w - num_past
        grad_out = grad_out.contiguous()  # autograd materialises unused outputs' gradients as zeros
        if grad_lse.numel() == 0:  # lse not requested
            grad_lse = None
        dq = torch.empty_like(q)
        # key/value gradients in the padded coordinates of the windows (front zero keys first)
        dk_pad = k.new_empty(B, k.shape[1], front + k.shape[2], k.shape[3])
        dv_pad = v.new_empty(B, v.shape[1], front + v.shape[2], v.shape[3])
        for bi in range(B):
            for h in range(Hq):
                hk = h // group
                do, p, qb = grad_out[bi, h].view(n, b, -1), probs[bi, h], q[bi, h].view(n, b, d)
                kws = _windows(k[bi, hk], w, b, num_past, n)
                dp = torch.empty_like(p)
                for sl, vw in _windows(v[bi, hk], w, b, num_past, n):
                    torch.bmm(do[sl], vw.transpose(1, 2), out=dp[sl])
                ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
                if grad_lse is not None:  # d lse / d score = the softmax probability
                    ds.addcmul_(p, grad_lse[bi, h].view(n, b, 1))
                if tanh is not None:
                    ds.mul_(1.0 - tanh[bi, h].square())
                dqb = dq[bi, h].view(n, b, d)
                for sl, kw in kws:
                    dqb[sl].baddbmm_(ds[sl], kw, beta=0.0, alpha=scale)
                # span j of window i holds padded key block i + j; the last span is block i's own keys
                first = h % group == 0  # the first query head of a KV group overwrites
                for grad, weights, rhs, alpha in ((dk_pad, ds, qb, scale), (dv_pad, p, do, 1.0)):
                    g = grad[bi, hk]
                    if first:
                        g[:w].zero_()
                    for j in reversed(range(spans)):
                        own = j == spans - 1
                        g[j * b: (j + n) * b].view(n, b, -1).baddbmm_(
                            weights[..., j * b: (j + 1) * b].transpose(1, 2), rhs,
                            beta=0.0 if own and first else 1.0, alpha=alpha,
                        )
        return dq, dk_pad[:, :, front:], dv_pad[:, :, front:], None, None, None, None, None, None, None


def _window_mask(
    key_padding_mask: torch.Tensor | None, num_keys: int, window: int, blocks: int, num_past: int, device,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys each query block may see, in the blocked layout of the forms below.

    Keys are front-padded so query 0 sits at padded index ``w`` (``w - num_past`` padding
    keys, then the cached and the new keys, then the tail up to ``blocks * b`` queries); query
    block ``c`` (``b = block`` queries, default ``w``) scores padded keys ``c b .. c b + w + b - 1``.
    Returns ``allowed (B|1, n, b, w + b)`` and ``q_valid (B|1, n, b)``. Padded queries (and the
    tail) keep their own key, so no row is all -inf; the callers zero their outputs.
    """
    w, n = window, blocks
    b = w if block is None else block
    valid = (torch.ones(1, num_keys, dtype=torch.bool, device=device) if key_padding_mask is None
             else key_padding_mask.bool())
    valid = F.pad(valid, (w - num_past, n * b + num_past - num_keys), value=False)  # (B|1, w + n b)
    i = torch.arange(b, device=device)[:, None]
    r = torch.arange(w + b, device=device)[None, :]
    band = (r > i) & (r <= i + w)  # query i of a block sees window keys i+1 .. i+w
    q_valid = valid[:, w:].view(-1, n, b)
    allowed = (band & valid.unfold(1, w + b, b)[:, :, None, :]) | (~q_valid[..., None] & (r == i + w))
    return allowed, q_valid


def block_layout(
    q: torch.Tensor, kv: tuple[torch.Tensor, ...], window: int, num_past: int, key_padding_mask: torch.Tensor | None,
):
    """The blocked layout shared by the SDPA form, :func:`sliding_window_lse` and LAVO's local
    attention (:func:`retrofit.ops.lavo.local_attention`).

    Queries ``(B, Hq, Tq, d)`` -> ``(B, Hkv, n, group w, d)`` (query heads of a GQA group stacked
    per block); each key-like tensor ``(B, Hkv, num_past + Tq, c)`` -> ``(B, Hkv, n, 2w, c)``
    (the previous and the own key block of each query block); ``allowed`` ``(B|1, 1, n, group w,
    2w)``, ``q_valid`` ``(B|1, n, w)`` from :func:`_window_mask`; ``n`` query blocks.
    """
    Tq, Hq = q.shape[2], q.shape[1]
    Hkv, Tk = kv[0].shape[1], kv[0].shape[2]
    w, group = window, Hq // Hkv
    n = -(-Tq // w)
    tail = n * w - Tq
    qb = query_blocks(q, Hkv, w, tail)
    allowed, q_valid = _window_mask(key_padding_mask, Tk, w, n, num_past, q.device)
    Bm = allowed.shape[0]
    allowed = allowed.unsqueeze(2).expand(Bm, n, group, w, 2 * w).reshape(Bm, 1, n, group * w, 2 * w)
    # key j (past keys at -num_past..-1) sits at padded index j + w
    return qb, tuple(two_blocks(F.pad(x, (0, 0, w - num_past, tail)), w) for x in kv), allowed, q_valid, n


def _banded_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scaling: float,
    softcap: float | None,
    key_padding_mask: torch.Tensor | None,
    num_past: int,
    block: int | None = None,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The blocked form through :class:`_BandedSWA`; ``num_past <= window``; ``block`` queries per
    block (a divisor of ``window``; default :func:`_query_block`). Returns ``(B, Hq, Tq, Dv)``, and
    with ``with_lse`` also the window log-sum-exp ``(B, Hq, Tq)`` (fp32 or wider, differentiable)."""
    B, Hq, Tq, d = q.shape
    Tk, w = k.shape[2], window
    b = _query_block(w) if block is None else block
    if w % b:
        raise ValueError(f"block ({b}) must divide the window ({w})")
    compute = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 inputs: fp32 GEMMs and softmax
    n = -(-Tq // b)
    tail = n * b - Tq

    def prepared(x: torch.Tensor) -> torch.Tensor:  # no copy when already fine
        x = x.to(compute)
        return (F.pad(x, (0, 0, 0, tail)) if tail else x).contiguous()

    allowed, q_valid = _window_mask(key_padding_mask, Tk, w, n, num_past, q.device, block=b)
    out_dtype = v.dtype
    q, k, v = prepared(q), prepared(k), prepared(v)
    allowed = allowed[:, None]
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    span = n if needs_grad else max(1, NO_GRAD_SCORE_BYTES // (B * Hq * b * (w + b) * q.element_size()))
    if span >= n:
        out, lse = _BandedSWA.apply(q, k, v, allowed, w, b, num_past, scaling, softcap, with_lse)
    else:  # no graph to keep: score ``span`` query blocks at a time, in memory bounded by the budget
        pieces = []
        for s in range(0, n, span):
            e = min(n, s + span)
            past = min(w, num_past + s * b)  # keys before block s that its windows reach
            keys = slice(num_past + s * b - past, num_past + e * b)
            pieces.append(_BandedSWA.apply(q[:, :, s * b : e * b], k[:, :, keys], v[:, :, keys], allowed[:, :, s:e],
                                           w, b, past, scaling, softcap, with_lse))
        out = torch.cat([o for o, _ in pieces], dim=2)
        lse = torch.cat([x for _, x in pieces], dim=2) if with_lse else pieces[0][1]
    out = out[:, :, :Tq] if tail else out
    if key_padding_mask is not None:
        out = out * q_valid.reshape(-1, 1, n * b, 1)[:, :, :Tq].to(out.dtype)
    if with_lse:
        return out.to(out_dtype), lse[:, :, :Tq]
    return out.to(out_dtype)


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
    """Causal sliding-window attention in blocks, O(Tq w d) time and memory; ``Tq <= w`` takes the dense form.

    On CPU :class:`_BandedSWA` (blocks of :func:`_query_block` queries against their ``w + b``
    keys; no k/v copies, own backward), or without autograd PyTorch's fused attention kernel where it
    is faster (:func:`_fused_form`); elsewhere blocks of ``w`` queries against their own and
    the previous key block through SDPA with a boolean mask (soft-capping, which SDPA cannot
    express, through a masked softmax).

    Args:
        q: ``(B, Hq, Tq, d)`` queries.
        k: ``(B, Hkv, num_past + Tq, d)`` keys (``Hq % Hkv == 0``).
        v: ``(B, Hkv, num_past + Tq, Dv)`` values.
        window: ``w``: query t sees keys ``t - w < s <= t``.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, num_past + Tq)`` bool, True for real tokens; padded queries output 0.
        num_past: cached keys in front of the queries' own (only the last ``w - 1`` are read).

    Returns:
        ``(B, Hq, Tq, Dv)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import sliding_window_attention
        >>> q = torch.randn(1, 4, 32, 8)
        >>> k, v = torch.randn(1, 2, 35, 8), torch.randn(1, 2, 35, 8)  # 3 cached keys first
        >>> sliding_window_attention(q, k, v, 8, num_past=3).shape
        torch.Size([1, 4, 32, 8])
    """
    Tq, d = q.shape[2], q.shape[3]
    k, v, num_past, key_padding_mask = window_keys(q, k, v, window, num_past, key_padding_mask)
    fused = _fused_form(q, k, v, window, scaling, softcap, key_padding_mask, num_past)
    if fused is not None:
        return fused[0]
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
    Hkv, w = k.shape[1], window
    group = Hq // Hkv
    qb, (kb, vb), allowed, q_valid, n = block_layout(q, (k, v), window, num_past, key_padding_mask)

    if softcap is None:  # 4-D, as SDPA's fused CUDA kernels require: a 5-D call runs the math kernel
        mask = allowed if allowed.shape[0] == 1 else allowed.expand(B, Hkv, *allowed.shape[2:])
        out = F.scaled_dot_product_attention(qb.flatten(0, 1), kb.flatten(0, 1), vb.flatten(0, 1),
                                             attn_mask=mask.flatten(0, 1), scale=scaling).unflatten(0, (B, Hkv))
    else:
        scores = soft_cap(upcast(torch.matmul(qb, kb.transpose(-1, -2))) * scaling, softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), vb)
    out = from_blocks(out, group)[:, :, :Tq]
    if key_padding_mask is not None:
        out = out * q_valid.reshape(-1, 1, n * w, 1)[:, :, :Tq].to(out.dtype)
    return out


def _fused_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scaling: float,
    key_padding_mask: torch.Tensor | None,
    num_past: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked form through the fused CPU kernel (callers check :func:`_fused_serves`): each block
    of ``w`` queries (a GQA group's heads stacked) against its own and the previous key block, masked
    to each query's window, one kernel call per block. Returns ``(out (B, Hq, Tq, Dv), lse (B, Hq, Tq)
    fp32)``."""
    Tq, group = q.shape[2], q.shape[1] // k.shape[1]
    qb, (kb, vb), allowed, q_valid, n = block_layout(q, (k, v.to(q.dtype)), window, num_past, key_padding_mask)
    outs, lses = [], []
    for c in range(n):  # one block's (group w) x 2w bias at a time
        bias = torch.zeros(allowed[:, :, c].shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed[:, :, c],
                                                                                              float("-inf"))
        out, lse = _FUSED_CPU(qb[:, :, c], kb[:, :, c], vb[:, :, c], 0.0, False, attn_mask=bias, scale=scaling)
        outs.append(out)
        lses.append(lse)
    out = from_blocks(torch.stack(outs, 2), group)[:, :, :Tq]
    lse = from_blocks(torch.stack(lses, 2), group)[:, :, :Tq].float()
    if key_padding_mask is not None:
        out = out * q_valid.reshape(-1, 1, n * window, 1)[:, :, :Tq].to(out.dtype)
    return out.to(v.dtype), lse


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
    """Log-sum-exp of each query's window scores, in the blocked O(T w) layout; differentiable.

    Same window and masks as :func:`sliding_window_attention`. Used to merge the window softmax
    with other keys (attention sinks) into one softmax.

    Args:
        q: ``(B, Hq, Tq, d)`` queries.
        k: ``(B, Hkv, num_past + Tq, d)`` keys (``Hq % Hkv == 0``).
        window: ``w``: query t sees keys ``t - w < s <= t``.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, num_past + Tq)`` bool, True for real tokens.
        num_past: cached keys in front of the queries' own.

    Returns:
        ``(B, Hq, Tq)`` in fp32 or wider.

    Example:
        >>> import torch
        >>> from retrofit.ops import sliding_window_lse
        >>> sliding_window_lse(torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), 8).shape
        torch.Size([1, 4, 32])
    """
    B, Hq, Tq, d = q.shape
    Hkv = k.shape[1]
    k, _, num_past, key_padding_mask = window_keys(q, k, None, window, num_past, key_padding_mask)
    if Tq <= window:  # short query blocks (decoding, short sequences): dense over <= 2w keys, no w-padding
        scores, _ = _dense_scores(q, k, window, scaling, softcap, key_padding_mask, num_past)
        return torch.logsumexp(scores, dim=-1).view(B, Hq, Tq)
    scaling = d**-0.5 if scaling is None else scaling
    qb, (kb,), allowed, _, _ = block_layout(q, (k,), window, num_past, key_padding_mask)
    scores = soft_cap(upcast(torch.matmul(qb, kb.transpose(-1, -2))) * scaling, softcap)
    lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # (B, Hkv, n, group w)
    return from_blocks(lse, Hq // Hkv)[:, :, :Tq]


def sliding_window_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sliding_window_attention(...), sliding_window_lse(...))`` of the same arguments.

    On CPU with more queries than the window, one pass of :class:`_BandedSWA` yields both (the
    log-sum-exp is taken from the scores the softmax uses): the separate
    :func:`sliding_window_lse` scores 2w keys per query again, which cost 2.6x the window
    attention itself at w = 2048 (BENCHMARKS.md). Elsewhere the two functions run apart.

    Args:
        q: ``(B, Hq, Tq, d)`` queries.
        k: ``(B, Hkv, num_past + Tq, d)`` keys (``Hq % Hkv == 0``).
        v: ``(B, Hkv, num_past + Tq, Dv)`` values.
        window: ``w``: query t sees keys ``t - w < s <= t``.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, num_past + Tq)`` bool, True for real tokens.
        num_past: cached keys in front of the queries' own.

    Returns:
        ``(out (B, Hq, Tq, Dv) in v's dtype, lse (B, Hq, Tq) in fp32 or wider)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import sliding_window_attention_with_lse
        >>> out, lse = sliding_window_attention_with_lse(torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8),
        ...                                              torch.randn(1, 2, 32, 8), 8)
        >>> out.shape, lse.shape
        (torch.Size([1, 4, 32, 8]), torch.Size([1, 4, 32]))
    """
    k, v, num_past, key_padding_mask = window_keys(q, k, v, window, num_past, key_padding_mask)
    fused = _fused_form(q, k, v, window, scaling, softcap, key_padding_mask, num_past)
    if fused is not None:
        return fused
    if q.device.type != "cpu" or q.shape[2] <= window:
        kw = dict(scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, num_past=num_past)
        return sliding_window_attention(q, k, v, window, **kw), sliding_window_lse(q, k, window, **kw)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = softcap if softcap is not None and softcap > 0 else None
    return _banded_blocked(q, k, v, window, scaling, softcap, key_padding_mask, num_past, with_lse=True)
