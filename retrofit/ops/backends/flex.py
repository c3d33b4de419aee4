"""The ``flex`` backend: sliding-window attention on PyTorch flex attention with a block-sparse
mask (compiled on CUDA; eager elsewhere, which materialises the scores: for tests only).
Runs only on request (``backend="flex"`` / ``RETROFIT_BACKEND=flex``); window convention and
shapes as :mod:`retrofit.ops.backends.flash`.
"""
from __future__ import annotations

import functools

import torch

from retrofit.ops._common import window_keys
from retrofit.ops.backends.registry import Backend, Kernel, register_backend

__all__ = ["BACKEND", "sliding_window_attention_flex"]


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
    Hkv = k.shape[1]
    k, v, num_past, key_padding_mask = window_keys(q, k, v, window, num_past, key_padding_mask)
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


BACKEND = register_backend(
    Backend(
        name="flex",
        priority=10,
        kernels={"sliding_window_attention": Kernel(sliding_window_attention_flex, auto=False)},
        package="torch.nn.attention.flex_attention",
        install_hint="torch >= 2.5",
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    )
)
