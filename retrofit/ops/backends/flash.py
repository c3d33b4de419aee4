"""The ``flash`` backend: sliding-window attention on flash-attn 2 (CUDA, fp16/bf16, equal q/k/v
head dims <= 256, no key padding mask: padded batches run elsewhere).

Window convention (as :mod:`retrofit.ops.sliding_window`): query t sees keys s with
``t - w < s <= t``, the last ``w`` tokens including itself. flash-attn's
``window_size=(left, right)`` lets query i see keys ``[i - left, i + right]``, so our window
is ``window_size=(w - 1, 0)`` with ``causal=True``. With cached keys (``Tk = num_past + Tq``)
flash-attn aligns the causal band to the bottom-right corner, i.e. query i sits at absolute
position ``num_past + i`` - exactly our convention.

Shapes: q ``(B, Hq, Tq, d)``, k/v ``(B, Hkv, Tk, d)`` (GQA: ``Hq % Hkv == 0``, handled by
the kernel natively); flash-attn takes ``(B, T, H, d)`` so we transpose in and out.
"""
from __future__ import annotations

import functools

import torch

from retrofit.ops.backends.registry import Backend, Call, register_backend
from retrofit.ops._common import window_keys

__all__ = ["BACKEND", "sliding_window_attention_flash"]


@functools.lru_cache(maxsize=None)
def _flash_attn_func():
    from flash_attn import flash_attn_func

    return flash_attn_func


def sliding_window_attention_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: None = None,
    num_past: int = 0,
) -> torch.Tensor:
    """flash-attn 2 (fp16/bf16, no padding mask). Returns ``(B, Hq, Tq, Dv)`` in q's dtype."""
    if key_padding_mask is not None:
        raise ValueError("the flash-attn sliding window takes no key padding mask")
    k, v, num_past, _ = window_keys(q, k, v, window, num_past)
    out = _flash_attn_func()(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=0.0,
        softmax_scale=q.shape[-1] ** -0.5 if scaling is None else scaling,
        causal=True,
        window_size=(window - 1, 0),
        softcap=0.0 if softcap is None or softcap <= 0 else float(softcap),
    )
    return out.transpose(1, 2)


def _check(op: str, call: Call) -> str | None:
    if call.key_padding_mask:
        return "flash-attn path has no key padding mask (padded batches use torch)"
    if (call.head_dim or 0) > 256 or call.head_dim != call.value_dim:
        return "flash-attn needs equal q/k/v head dims <= 256"
    if call.mixed_dtypes:
        return "flash-attn needs q, k, v of one dtype"
    return None


BACKEND = register_backend(
    Backend(
        name="flash",
        priority=20,
        kernels={"sliding_window_attention": sliding_window_attention_flash},
        package="flash_attn",
        install_hint="flash-attn",
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        check=_check,
    )
)
