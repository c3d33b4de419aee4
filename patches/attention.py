"""The ``"retrofit"`` attention implementation that converted models run under.

Converted layers need only the 2D key padding mask, never a T x T mask (a 262k-vocab model
at 32K tokens must fit). transformers 5.x builds masks through ``AttentionMaskInterface``
keyed by ``config._attn_implementation`` (``masking_utils.create_causal_mask`` /
``create_sliding_window_causal_mask``) and runs attention through ``AttentionInterface``.
:func:`install_attention_function` installs both under the name ``"retrofit"``:

* mask: flash-attention style. ``(B, past + T)`` bool (True = real token), or ``None`` when
  nothing is padded; it is handed on unsliced (a replaced layer takes its last ``T`` columns,
  a full-attention layer its last ``kv_len`` columns). Already-4D masks pass through.
* attention (used only by layers that stay full / native sliding-window attention): a native
  sliding-window layer whose keys outrun its window runs the O(T w) blocked kernel
  (``retrofit.ops.sliding_window_attention``: no T x T mask, so a hybrid model scores 128K
  tokens in bounded memory); otherwise SDPA with a causal + padding mask built here for that
  layer alone, or an eager softmax when Gemma 2 soft-capping is on (SDPA cannot express it).
  A full-attention layer holding a :class:`RopeCap` (``retrofit.surgery.cap_rope``) whose keys
  reach farther back than the cap scores those pairs at the capped RoPE distance
  (``retrofit.ops.capped_rope_attention``, ReRoPE-style): nothing changes inside the cap.

Padded query rows attend to themselves only (their outputs are discarded), so no row of
scores is all ``-inf`` and nothing turns NaN.

Packed documents (``position_ids`` that restart inside a row, no padding mask, no past keys):
the mask function keeps no T x T mask to make them block-diagonal, so the attention regroups
them, one padded row per document (:mod:`retrofit.layers.documents`, as the converted layers do).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

IMPLEMENTATION = "retrofit"

__all__ = ["IMPLEMENTATION", "ROPE_CAP_ATTR", "RopeCap", "install_attention_function", "retrofit_mask", "retrofit_attention_forward",
           "dense_mask"]

ROPE_CAP_ATTR = "retrofit_rope_cap"  # the attribute of an attention module that holds its RopeCap


class RopeCap(NamedTuple):
    """A full-attention layer's RoPE distance cap: pairs farther apart than ``distance`` are scored
    at ``distance``; ``inv_freq`` ``(F,)`` fp32, the layer's rotary frequencies."""

    distance: int
    inv_freq: torch.Tensor


def retrofit_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry: the 2D padding mask (bool) or None when all tokens are real."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        return attention_mask
    mask = attention_mask.bool()
    if torch.compiler.is_compiling():  # no data-dependent branch (graph break); an all-True mask is exact too
        return mask
    return None if bool(mask.all()) else mask


def dense_mask(
    q_len: int,
    kv_len: int,
    *,
    window: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Bool ``(B or 1, 1, q_len, kv_len)``: queries are the last ``q_len`` of ``kv_len`` positions.

    Allowed: ``s <= t`` and (with a window) ``s > t - window``, and ``s`` not padding. Padded
    queries see themselves only.
    """
    q_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        kv_valid = key_padding_mask[:, -kv_len:].bool()
        q_valid = kv_valid[:, -q_len:]
        allowed = (allowed & kv_valid[:, None, None, :]) | ((k_pos == q_pos)[None, None] & ~q_valid[:, None, :, None])
    return allowed


def retrofit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry for layers left as softmax attention.

    query ``(B, Hq, T, d)``, key/value ``(B, Hkv, K, d)`` (K = cached + new). Returns
    ``(B, T, Hq, d)`` as every transformers attention function does.
    """
    B, Hq, T, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    if K == T:
        from retrofit.layers.documents import packed_documents

        docs = packed_documents(kwargs.get("position_ids"), B, T, attention_mask)
        if docs is not None:  # packed documents: one padded row each, as the converted layers read them
            rest = {k: v for k, v in kwargs.items() if k != "position_ids"}
            out, _ = retrofit_attention_forward(
                module, docs.split(query, 2), docs.split(key, 2), docs.split(value, 2), docs.valid, dropout=dropout,
                scaling=scaling, sliding_window=sliding_window, softcap=softcap, **rest)
            return docs.merge(out, 1), None
    scaling = d**-0.5 if scaling is None else scaling
    dropout = dropout if module.training else 0.0
    cap = getattr(module, ROPE_CAP_ATTR, None)
    if (cap is not None and sliding_window is None and K - 1 > cap.distance and not (dropout and module.training)
            and (attention_mask is None or attention_mask.ndim == 2)):
        from retrofit.ops import capped_rope_attention

        out = capped_rope_attention(
            query, key, value, cap.distance, cap.inv_freq, scaling=scaling, softcap=softcap or None,
            key_padding_mask=None if attention_mask is None else attention_mask[:, -K:].bool(),
        )
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and attention_mask.ndim == 4:
        mask = attention_mask  # prepared by the caller: use as-is
    elif sliding_window is not None and K > sliding_window and T > 1 and not (dropout and module.training):
        from retrofit.ops import sliding_window_attention  # dispatched: flash on CUDA, banded on CPU

        out = sliding_window_attention(
            query, key, value, int(sliding_window), scaling=scaling, softcap=softcap or None,
            key_padding_mask=None if attention_mask is None else attention_mask[:, -K:].bool(), num_past=K - T,
        )
        return out.transpose(1, 2).contiguous(), None
    else:
        kv_valid = attention_mask
        window = sliding_window if (sliding_window is not None and K > sliding_window) else None
        mask = None
        if kv_valid is not None or window is not None or (T != K and T != 1) or softcap:
            mask = dense_mask(T, K, window=window, key_padding_mask=kv_valid, device=query.device)
    if softcap:
        group = Hq // Hkv
        k = key.repeat_interleave(group, dim=1) if group > 1 else key
        v = value.repeat_interleave(group, dim=1) if group > 1 else value
        scores = torch.matmul(query, k.transpose(-1, -2)).float() * scaling
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        probs = F.dropout(probs, p=dropout, training=module.training)
        out = torch.matmul(probs, v)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
            is_causal=mask is None and T == K and T > 1, enable_gqa=Hq != Hkv,
        )
    return out.transpose(1, 2).contiguous(), None


def install_attention_function() -> str:
    """Install the ``"retrofit"`` attention and mask functions in transformers' interfaces (idempotent);
    returns the name to pass to ``set_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, retrofit_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, retrofit_mask)
    return IMPLEMENTATION
