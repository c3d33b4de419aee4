"""Grouped-query SDPA that stays on a fused kernel on CUDA.

``F.scaled_dot_product_attention(..., enable_gqa=True)`` reads each key/value head once for its
group of query heads, but on CUDA only the flash and cuDNN kernels accept that broadcast, and they
take fp16/bf16 without a mask and head dims up to 256. Anything else (fp32, an explicit mask)
falls back, silently, to the math kernel, which materialises every ``(Tq, Tk)`` score matrix:
``B x Hq x T^2`` floats, 9.7 GB for four 8K-token SmolLM2 sequences in fp32. There,
:func:`gqa_sdpa` repeats the key/value heads instead (a copy of K and V, ``Hq / Hkv`` times,
small next to the scores) so the memory-efficient kernel runs. On CPU it passes ``enable_gqa``
as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gqa_sdpa", "native_gqa_on_cuda", "repeat_kv_heads"]

_FUSED_GQA_DTYPES = (torch.float16, torch.bfloat16)
_FUSED_GQA_MAX_HEAD_DIM = 256


def repeat_kv_heads(x: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """Each KV head repeated over its query group.

    Args:
        x: ``(B, Hkv, T, D)`` keys or values.
        num_query_heads: ``Hq`` (a multiple of ``Hkv``).

    Returns:
        ``(B, Hq, T, D)`` (``x`` itself when ``Hq == Hkv``).

    Example:
        >>> import torch
        >>> from retrofit.ops import repeat_kv_heads
        >>> repeat_kv_heads(torch.randn(1, 2, 5, 8), 4).shape
        torch.Size([1, 4, 5, 8])
    """
    group = num_query_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def native_gqa_on_cuda(dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """Whether a CUDA fused kernel (flash / cuDNN) takes ``enable_gqa`` for these inputs."""
    return dtype in _FUSED_GQA_DTYPES and head_dim <= _FUSED_GQA_MAX_HEAD_DIM and not masked


def gqa_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` for ``Hq`` query heads over ``Hkv`` key/value heads.

    Args:
        q: ``(B, Hq, Tq, D)``.
        k, v: ``(B, Hkv, Tk, D)``, ``Hq`` a multiple of ``Hkv`` (query head ``h`` reads kv head
            ``h // (Hq / Hkv)``, as ``enable_gqa`` and ``repeat_interleave`` both do).
        attn_mask, is_causal, scale: as for SDPA (a bool mask: True where a query may attend).

    Returns:
        ``(B, Hq, Tq, D)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import gqa_sdpa
        >>> q, k, v = torch.randn(1, 6, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
        >>> gqa_sdpa(q, k, v, is_causal=True).shape
        torch.Size([1, 6, 5, 8])
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    gqa = {}
    if Hq != Hkv:
        if Hq % Hkv:
            raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
        if q.is_cuda and not native_gqa_on_cuda(q.dtype, q.shape[-1], attn_mask is not None):
            k, v = repeat_kv_heads(k, Hq), repeat_kv_heads(v, Hq)
        else:
            gqa = {"enable_gqa": True}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **gqa)
