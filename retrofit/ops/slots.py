"""Dense softmax attention of a few queries over a given key set with an explicit mask.

Two callers: a few-query call with attention sinks (:func:`retrofit.ops.sinks.sink_window_attention`
concatenates ``[sinks; window keys]`` and builds the band mask), and one decoding step over a
converted layer's preallocated key slots. The decoding cache keeps its attention sinks and its
``w``-token window in one buffer, ``[n sink slots | w ring slots]``
(:class:`retrofit.layers.window.WindowLayerCache`): the new token overwrites the ring slot of the
token that just left the window, so a step copies one key instead of concatenating and
re-slicing the whole window. Slot order carries no meaning (keys are post-RoPE); ``allowed``
says which slots the query sees: filled, real (not padding) and, for a sink, before the query's
window (a sink still inside the window is already one of the ring slots).

Shapes: q ``(B, Hq, Tq, d)``, k ``(B, Hkv, S, d)``, v ``(B, Hkv, S, D)``; GQA groups share k/v.
"""
from __future__ import annotations

import torch

from retrofit.ops.sdpa import gqa_sdpa

__all__ = ["masked_dense_attention", "slot_attention_step"]


def masked_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One softmax per query over the keys ``allowed`` marks (fp32 scores at least): the few-query form
    of a window with its sinks (:func:`retrofit.ops.sinks.sink_window_attention`) and of a decoding
    step over key slots.

    Args:
        q: ``(B, Hq, Tq, d)`` queries.
        k: ``(B, Hkv, S, d)`` keys (``Hq % Hkv == 0``), post-RoPE, in any order.
        v: ``(B, Hkv, S, D)`` values.
        allowed: ``(B, Tq, S)`` bool, the keys each query sees.
        scaling: score scale.
        softcap: ``softcap * tanh(score / softcap)`` when set.
        with_lse: also return the log-sum-exp of each query's allowed scores ``(B, Hq, Tq)``.

    Returns:
        ``(B, Hq, Tq, D)`` in v's dtype, or with ``with_lse`` ``(out, lse)``. A query with no allowed
        key gets NaN; callers zero such rows.

    Example:
        >>> import torch
        >>> from retrofit.ops import masked_dense_attention
        >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
        >>> allowed = torch.ones(1, 3, 5, dtype=torch.bool).tril(2)
        >>> masked_dense_attention(q, k, v, allowed, scaling=8 ** -0.5).shape
        torch.Size([1, 4, 3, 8])
    """
    B, Hq, Tq, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv
    s = torch.matmul(q.reshape(B, Hkv, group * Tq, d), k.transpose(-1, -2))
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.view(B, Hkv, group, Tq, S).masked_fill(~allowed[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    out = torch.matmul(p.view(B, Hkv, group * Tq, S), v).view(B, Hq, Tq, v.shape[-1])
    return (out, torch.logsumexp(s, dim=-1).view(B, Hq, Tq)) if with_lse else out


def slot_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One decoding query per row over the key slots ``allowed`` marks.

    Args:
        q: ``(B, Hq, 1, d)`` the new token's query.
        k: ``(B, Hkv, S, d)`` key slots (``Hq % Hkv == 0``), post-RoPE, in any order.
        v: ``(B, Hkv, S, D)`` value slots.
        allowed: ``(B, S)`` bool, the slots the query sees (filled, real, and for a sink, before
            the window).
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        with_lse: also return the log-sum-exp of the allowed scores ``(B, Hq, 1)`` fp32 (a layer
            that weighs the window against another memory in one normalisation needs it).

    Returns:
        ``(B, Hq, 1, D)``, or with ``with_lse`` ``(out, lse)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import slot_attention_step
        >>> q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
        >>> allowed = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
        >>> slot_attention_step(q, k, v, allowed).shape
        torch.Size([2, 4, 1, 8])
    """
    if q.shape[2] != 1:
        raise ValueError(f"slot_attention_step takes one query per row, got {q.shape[2]}")
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    if softcap or with_lse:
        return masked_dense_attention(q, k, v, allowed[:, None, :], scaling=scaling, softcap=softcap, with_lse=with_lse)
    # one fused kernel (scores, mask, softmax, values) instead of six ops: most of a decoding step's
    # per-layer cost on a CPU is the number of small kernels, not their arithmetic
    return gqa_sdpa(q, k, v, attn_mask=allowed[:, None, None, :], scale=scaling)
