"""Sliding-window attention plus attention sinks: the window keys and the first ``n`` tokens.

Query ``t`` attends, in one softmax, to the keys ``t - w < s <= t`` (its window) and to the
``n`` sink keys (the first ``n`` real tokens of the sequence, StreamingLLM's attention sinks)
that lie before its window. A pretrained global layer puts much of its attention on BOS; a
plain window drops that mass onto local tokens (Gemma 3 270M, global layers cut to w = 512,
held-out 4K perplexity 42.1 vs 27.1; with one sink 29.1).

Exactly one softmax over both key sets is formed from two parts merged by their
log-normalisers: the window part (the O(T w) kernel of :mod:`retrofit.ops.sliding_window`
plus the window's log-sum-exp, from the same pass on CPU, else from :func:`sliding_window_lse`) and the sink part (``T x n``
scores). A sink inside the query's window is only counted by the window part.

Positions are stream indices: query ``i`` of this call sits at ``q_start + i`` (tokens seen
before the call, padding included), sink ``j`` at ``sink_idx[b, j]``; the window is index-based
as in the kernel.

Capped sink distance (``far``, :func:`capped_sinks`): past the pretraining context a query would
see its sinks at RoPE distances the model never saw (the Gemma 3 270M hybrid, pretrained at 32K:
perplexity 31.5 over tokens 32K-64K of a held-out book uncapped, 22.2 capped; BENCHMARKS.md as
of 38c339f, "Sinks re-positioned"). Like StreamingLLM, which gives the
cached sinks positions just before the window, a pair farther apart than ``distance`` is scored
as if exactly ``distance`` apart: ``R(distance - t) q_t . R(-j) k_j`` (:mod:`retrofit.ops.rope`).
Within ``distance`` nothing changes. Shapes: q ``(B, Hq, Tq, d)``, k/v ``(B, Hkv, num_past + Tq, d)``,
``sink_k``/``sink_v`` ``(B, Hkv, n, d)``, ``sink_idx``/``sink_valid`` ``(B, n)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import NamedTuple

from retrofit.ops._common import drop_unseen_past, real_tokens
from retrofit.ops.dispatched import (
    masked_dense_attention, sliding_window_attention, sliding_window_attention_with_lse, sliding_window_lse,
)
from retrofit.ops.rope import rope_rotate
from retrofit.ops.sliding_window import dense_window_mask

__all__ = [
    "FarSinks",
    "capped_sinks",
    "capped_sink_keys",
    "first_valid",
    "sink_window_attention",
    "sink_window_attention_reference",
]

# calls with at most this many queries run as one dense softmax over [sinks; window keys]
FUSED_MAX_QUERIES = 16


def first_valid(n: int, idx: torch.Tensor, valid: torch.Tensor, *tensors: torch.Tensor):
    """The first ``n`` valid candidates of each row, in stream order (how the sinks are chosen).

    Args:
        n: slots to keep.
        idx: ``(B, C)`` long stream indices of the candidates, ascending.
        valid: ``(B, C)`` bool, True for real tokens.
        *tensors: each ``(B, H, C, d)``, gathered alongside (the keys and values).

    Returns:
        ``(idx (B, n), valid (B, n), *tensors (B, H, n, d))``; a row with fewer than ``n`` valid
        candidates keeps invalid slots (valid False), never attended.

    Example:
        >>> import torch
        >>> from retrofit.ops import first_valid
        >>> k = torch.randn(1, 2, 5, 8)
        >>> valid = torch.tensor([[False, True, True, True, True]])
        >>> idx, valid, sink_k = first_valid(2, torch.arange(5)[None], valid, k)
        >>> idx.tolist(), valid.tolist(), sink_k.shape
        ([[1, 2]], [[True, True]], torch.Size([1, 2, 2, 8]))
    """
    B, C = idx.shape
    if C < n:  # pad candidates to n slots
        pad = n - C
        idx = F.pad(idx, (0, pad), value=-1)
        valid = F.pad(valid, (0, pad), value=False)
        tensors = tuple(F.pad(t, (0, 0, 0, pad)) for t in tensors)
        C = n
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :n]  # valid first, in order
    out = [idx.gather(1, order), valid.gather(1, order)]
    for t in tensors:
        out.append(t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])))
    return tuple(out)


class FarSinks(NamedTuple):
    """Scores for sink pairs farther apart than ``distance``: ``q`` ``(B, Hq, Tq, d)`` the queries
    rotated to ``distance``, ``k`` ``(B, Hkv, n, d)`` the sink keys rotated back to position 0."""

    q: torch.Tensor
    k: torch.Tensor
    distance: int


def capped_sinks(q: torch.Tensor, sink_k: torch.Tensor, sink_idx: torch.Tensor, q_start: int, distance: int,
                 inv_freq: torch.Tensor) -> FarSinks | None:
    """The :class:`FarSinks` of a call whose queries see their sinks from farther than ``distance``.

    Args:
        q: ``(B, Hq, Tq, d)`` post-RoPE queries at stream positions ``q_start + i``.
        sink_k: ``(B, Hkv, n, d)`` post-RoPE sink keys.
        sink_idx: ``(B, n)`` the sinks' stream positions.
        q_start: stream position of the first query.
        distance: the cap.
        inv_freq: ``(F,)`` the layer's rotary frequencies.

    Returns:
        :class:`FarSinks` (q ``(B, Hq, Tq, d)`` rotated to ``distance``, k ``(B, Hkv, n, d)`` rotated
        back to position 0), or None when no pair can be that far apart.

    Example:
        >>> import torch
        >>> from retrofit.ops import capped_sinks
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> q, sink_k, sink_idx = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 2, 8), torch.tensor([[0, 1]])
        >>> far = capped_sinks(q, sink_k, sink_idx, 100, 50, inv_freq)
        >>> far.q.shape, far.k.shape, far.distance
        (torch.Size([1, 4, 6, 8]), torch.Size([1, 2, 2, 8]), 50)
        >>> capped_sinks(q, sink_k, sink_idx, 0, 50, inv_freq) is None  # queries at 0..5: every sink within 50
        True
    """
    Tq = q.shape[2]
    if q_start + Tq - 1 <= distance:  # sink indices are >= 0: no query is far from any sink
        return None
    t = torch.arange(q_start, q_start + Tq, device=q.device)
    return FarSinks(rope_rotate(q, distance - t, inv_freq), rope_rotate(sink_k, -sink_idx[:, None, :], inv_freq), distance)


def capped_sink_keys(sink_k: torch.Tensor, sink_idx: torch.Tensor, t: int, distance: int,
                     inv_freq: torch.Tensor) -> torch.Tensor:
    """Sink keys as one query at ``t`` must see them.

    Each sink farther than ``distance`` is moved to ``t - distance``: the decoding step's
    in-place form of :class:`FarSinks`.

    Args:
        sink_k: ``(B, Hkv, n, d)`` post-RoPE sink keys.
        sink_idx: ``(B, n)`` the sinks' stream positions.
        t: the query's stream position.
        distance: the cap.
        inv_freq: ``(F,)`` the layer's rotary frequencies.

    Returns:
        ``(B, Hkv, n, d)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import capped_sink_keys
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> sink_k = torch.randn(1, 2, 2, 8)
        >>> capped_sink_keys(sink_k, torch.tensor([[0, 1]]), 100, 50, inv_freq).shape
        torch.Size([1, 2, 2, 8])
        >>> torch.equal(capped_sink_keys(sink_k, torch.tensor([[0, 1]]), 30, 50, inv_freq), sink_k)  # all within
        True
    """
    shift = (t - distance - sink_idx).clamp(min=0)  # (B, n); 0 = within the cap, unchanged
    return rope_rotate(sink_k, shift[:, None, :], inv_freq)


def sink_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    sink_idx: torch.Tensor,
    sink_valid: torch.Tensor,
    *,
    q_start: int = 0,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
    far: FarSinks | None = None,
    backend: str | None = "auto",
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over each query's window keys and its attention sinks, in one softmax.

    The window attention and its log-sum-exp are the dispatched ops (``backend=`` is passed to
    both); on CPU, where the torch kernel is the only one, they come from one pass
    (the dispatched :func:`~retrofit.ops.sliding_window_attention_with_lse`). Calls with few queries
    run one dense softmax over ``[sinks; window keys]`` (the dispatched :func:`~retrofit.ops.masked_dense_attention`).
    Differentiable in q, k, v, sink_k, sink_v.

    Args:
        q: ``(B, Hq, Tq, d)`` queries at stream positions ``q_start + i``.
        k: ``(B, Hkv, num_past + Tq, d)`` window keys (``Hq % Hkv == 0``).
        v: ``(B, Hkv, num_past + Tq, Dv)`` window values.
        window: ``w``: query t sees keys ``t - w < s <= t``.
        sink_k: ``(B, Hkv, n, d)`` sink keys (from :func:`first_valid`).
        sink_v: ``(B, Hkv, n, Dv)`` sink values.
        sink_idx: ``(B, n)`` the sinks' stream positions.
        sink_valid: ``(B, n)`` bool; a sink is seen by the queries whose window it lies before.
        q_start: stream position of the first query.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, num_past + Tq)`` bool, True for real tokens; padded queries output 0.
        num_past: cached window keys in front of the queries' own.
        far: the capped scores of sink pairs more than ``far.distance`` apart (:func:`capped_sinks`).
        backend: the backend of the window ops (and of the few-query dense softmax).
        with_lse: also return the log-sum-exp of each query's scores over its window and sinks
            (what another key set beside them is weighed against).

    Returns:
        ``(B, Hq, Tq, Dv)``; with ``with_lse``, ``(out, lse (B, Hq, Tq) fp32)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import first_valid, sink_window_attention
        >>> q, k, v = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
        >>> mask = torch.ones(1, 32, dtype=torch.bool)
        >>> idx, valid, sink_k, sink_v = first_valid(1, torch.arange(32)[None], mask, k, v)
        >>> sink_window_attention(q, k, v, 8, sink_k, sink_v, idx, valid).shape
        torch.Size([1, 4, 32, 8])
    """
    B, Hq, Tq, d = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    if Tq <= FUSED_MAX_QUERIES and far is None:
        return _one_dense_softmax(q, k, v, window, sink_k, sink_v, sink_idx, sink_valid, q_start=q_start,
                                  scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, num_past=num_past,
                                  with_lse=with_lse, backend=backend)
    window_kw = dict(scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, num_past=num_past)
    if q.device.type == "cpu":  # the torch kernel is the only CPU window kernel; it gives both in one pass
        o_w, lse_w = sliding_window_attention_with_lse(q, k, v, window, backend=backend, **window_kw)
    else:
        o_w = sliding_window_attention(q, k, v, window, backend=backend, **window_kw)
        lse_w = sliding_window_lse(q, k, window, backend=backend, **window_kw)  # (B, Hq, Tq) fp32
    n = sink_k.shape[2]
    qg = q.reshape(B, Hkv, group * Tq, d)
    s = torch.matmul(qg, sink_k.transpose(-1, -2)).view(B, Hkv, group, Tq, n)
    t = torch.arange(Tq, device=q.device) + q_start
    if far is not None:
        s_far = torch.matmul(far.q.reshape(B, Hkv, group * Tq, d), far.k.transpose(-1, -2)).view(B, Hkv, group, Tq, n)
        is_far = (t[None, :, None] - sink_idx[:, None, :]) > far.distance  # (B, Tq, n)
        s = torch.where(is_far[:, None, None], s_far, s)
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    # a sink is counted here only when it lies before the query's window (else the window has it)
    seen = sink_valid[:, None, :] & (sink_idx[:, None, :] <= (t - window)[None, :, None])  # (B, Tq, n)
    s = s.masked_fill(~seen[:, None, None], float("-inf"))
    lse_s = torch.logsumexp(s, dim=-1)  # (B, Hkv, group, Tq); -inf where no sink is seen
    any_seen = seen.any(-1)[:, None, None]  # (B, 1, 1, Tq)
    p = torch.softmax(s.masked_fill(~any_seen[..., None], 0.0), dim=-1)
    o_s = torch.matmul(p.to(sink_v.dtype).reshape(B, Hkv, group * Tq, n), sink_v).view(B, Hq, Tq, -1)
    lse_s = torch.where(any_seen, lse_s, torch.zeros_like(lse_s)).reshape(B, Hq, Tq)
    w_s = torch.where(any_seen.reshape(B, 1, Tq).expand(B, Hq, Tq), torch.sigmoid(lse_s - lse_w), torch.zeros_like(lse_w))
    out = o_w + w_s[..., None].to(o_w.dtype) * (o_s.to(o_w.dtype) - o_w)
    if key_padding_mask is not None:  # padded queries return zeros, as the window kernel does
        out = out * key_padding_mask[:, -Tq:].to(out.dtype)[:, None, :, None]
    if with_lse:
        return out, torch.where(any_seen.reshape(B, 1, Tq), torch.logaddexp(lse_w, lse_s), lse_w)
    return out


def _one_dense_softmax(q, k, v, window, sink_k, sink_v, sink_idx, sink_valid, *, q_start, scaling, softcap,
                       key_padding_mask, num_past, with_lse: bool = False, backend: str | None = "auto"):
    """A few queries (decoding, short chunks): one dense softmax over ``[sinks; the window's keys]``.

    The same function as the window kernel + log-sum-exp merge, in a tenth of the small ops:
    a decoding step of a converted layer otherwise runs two dense score blocks and the merge.
    """
    B, Hq, Tq, d = q.shape
    # only the last w - 1 past keys can be seen (as the window kernel drops them)
    k, v, num_past, key_padding_mask = drop_unseen_past(k, v, num_past, window, key_padding_mask)
    Tk = k.shape[2]
    kk, vv = torch.cat([sink_k.to(k.dtype), k], dim=2), torch.cat([sink_v.to(v.dtype), v], dim=2)
    # a padded query sees only its own key (its output is zeroed)
    band, q_valid = dense_window_mask(Tq, Tk, window, key_padding_mask, num_past, q.device)
    band = band[:, 0].expand(B, Tq, Tk)
    t = torch.arange(Tq, device=q.device) + q_start
    seen = sink_valid[:, None, :] & (sink_idx[:, None, :] <= (t - window)[None, :, None])  # (B, Tq, n)
    if q_valid is not None:
        q_valid = q_valid.view(B, Tq)
        seen = seen & q_valid[:, :, None]
    result = masked_dense_attention(q, kk, vv, torch.cat([seen, band], dim=-1), scaling=scaling, softcap=softcap,
                                    with_lse=with_lse, backend=backend)
    out, lse = result if with_lse else (result, None)
    if q_valid is not None:
        out = out * q_valid[:, None, :, None].to(out.dtype)
    return (out, lse) if with_lse else out


def sink_window_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    sinks: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Dense O(T^2) form over one whole sequence (no cache): the mask is band OR first-``sinks``-valid.

    Args:
        q: ``(B, Hq, T, d)`` queries (post-RoPE, or pre-RoPE with ``rope``).
        k: ``(B, Hkv, T, d)`` keys (``Hq % Hkv == 0``).
        v: ``(B, Hkv, T, Dv)`` values.
        window: ``w``: query t sees keys ``t - w < s <= t``.
        sinks: the first ``sinks`` real tokens of each row are sinks.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, T)`` bool, True for real tokens; padded queries output 0.
        rope: ``(inv_freq, distance)``: q and k are given before RoPE; they are rotated to their
            stream positions here, and a sink more than ``distance`` before a query (and outside
            its window, else it is one of the window's keys) is scored at ``distance``.

    Returns:
        ``(B, Hq, T, Dv)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import sink_window_attention_reference
        >>> q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
        >>> sink_window_attention_reference(q, k, v, 8, 1).shape
        torch.Size([1, 4, 20, 8])
    """
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    valid = real_tokens(key_padding_mask, B, T, q.device)
    rank = valid.long().cumsum(-1)  # 1-based rank of each real token
    is_sink = valid & (rank <= sinks)
    ti = torch.arange(T, device=q.device)[:, None]
    si = torch.arange(T, device=q.device)[None, :]
    if rope is None:
        scores = torch.matmul(q, kk.transpose(-1, -2))
    else:  # q, k are pre-RoPE: rotate here, and score far sink pairs at exactly the cap
        inv_freq, distance = rope
        pos = torch.arange(T, device=q.device)
        scores = torch.matmul(rope_rotate(q, pos, inv_freq), rope_rotate(kk, pos, inv_freq).transpose(-1, -2))
        capped = torch.matmul(rope_rotate(q, torch.full((T,), distance), inv_freq), kk.transpose(-1, -2))
        far = is_sink[:, None, :] & ((ti - si > distance) & (si <= ti - window))[None]  # (B, T, T): sinks, not window keys
        scores = torch.where(far[:, None], capped, scores)
    scores = scores.to(torch.promote_types(q.dtype, torch.float32)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = (si <= ti) & ((si > ti - window)[None] | is_sink[:, None, :]) & valid[:, None, :]
    allowed = allowed | ((si == ti)[None] & ~valid[:, :, None])  # padded queries see themselves
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, -1).to(v.dtype), vv)
    return out * valid[:, None, :, None].to(out.dtype)
