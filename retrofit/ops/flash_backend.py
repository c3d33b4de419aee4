"""Sliding-window attention on flash-attn 2 or PyTorch flex attention (CUDA fast paths).

Window convention (as :mod:`retrofit.ops.sliding_window`): query t sees keys s with
``t - w < s <= t``, the last ``w`` tokens including itself. flash-attn's
``window_size=(left, right)`` lets query i see keys ``[i - left, i + right]``, so our window
is ``window_size=(w - 1, 0)`` with ``causal=True``. With cached keys (``Tk = num_past + Tq``)
flash-attn aligns the causal band to the bottom-right corner, i.e. query i sits at absolute
position ``num_past + i`` - exactly our convention.

Shapes: q ``(B, Hq, Tq, d)``, k/v ``(B, Hkv, Tk, d)`` (GQA: ``Hq % Hkv == 0``, handled by
both kernels natively); flash-attn takes ``(B, T, H, d)`` so we transpose in and out.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["sliding_window_attention_flash", "sliding_window_attention_flex"]


@functools.lru_cache(maxsize=None)
def _flash_attn_func():
    from flash_attn import flash_attn_func

    return flash_attn_func


def _drop_unseen_past(k: torch.Tensor, v: torch.Tensor, num_past: int, window: int, mask: torch.Tensor | None = None):
    """Only the last ``w - 1`` cached keys can be seen by the first query; drop the rest."""
    if num_past > window:
        drop = num_past - window
        k, v = k[:, :, drop:], v[:, :, drop:]
        mask = None if mask is None else mask[:, drop:]
        num_past = window
    return k, v, num_past, mask


def sliding_window_attention_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    num_past: int = 0,
) -> torch.Tensor:
    """flash-attn 2 (fp16/bf16, no padding mask). Returns ``(B, Hq, Tq, Dv)`` in q's dtype."""
    Tq, Tk = q.shape[2], k.shape[2]
    if Tk != num_past + Tq:
        raise ValueError(f"keys ({Tk}) must be num_past ({num_past}) + queries ({Tq})")
    k, v, num_past, _ = _drop_unseen_past(k, v, num_past, window)
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


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _static_block_mask(Tq: int, Tk: int, window: int, num_past: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        t = q_idx + num_past
        return (kv_idx <= t) & (kv_idx > t - window)

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=Tq, KV_LEN=Tk, device=device)


def sliding_window_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
    compile: bool | None = None,
) -> torch.Tensor:
    """PyTorch flex attention with a block-sparse sliding-window mask; any float dtype.

    ``compile`` (default: on CUDA) wraps flex_attention in ``torch.compile``; eager flex
    materialises the scores and is for testing only. Padded queries return zeros.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, Hq, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Tk != num_past + Tq:
        raise ValueError(f"keys ({Tk}) must be num_past ({num_past}) + queries ({Tq})")
    k, v, num_past, key_padding_mask = _drop_unseen_past(k, v, num_past, window, key_padding_mask)
    Tk = k.shape[2]
    compile = q.device.type == "cuda" if compile is None else compile
    if key_padding_mask is None:
        block_mask = _static_block_mask(Tq, Tk, window, num_past, str(q.device))
        q_valid = None
    else:
        valid = key_padding_mask.bool()
        q_valid = valid[:, num_past:]
        offset = num_past

        def mask_mod(b, h, q_idx, kv_idx):
            t = q_idx + offset
            band = (kv_idx <= t) & (kv_idx > t - window)
            # a padded query keeps its own key so that its row is never empty; zeroed below
            return (band & valid[b, kv_idx]) | ((kv_idx == t) & ~valid[b, t])

        block_mask = create_block_mask(mask_mod, B=B, H=None, Q_LEN=Tq, KV_LEN=Tk, device=q.device)

    score_mod = None
    if softcap is not None and softcap > 0:
        cap = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    fn = _compiled_flex() if compile else flex_attention
    out = fn(
        q, k, v, score_mod=score_mod, block_mask=block_mask,
        scale=d**-0.5 if scaling is None else scaling, enable_gqa=Hq != Hkv,
    )
    if q_valid is not None:
        out = out * q_valid[:, None, :, None].to(out.dtype)
    return out
