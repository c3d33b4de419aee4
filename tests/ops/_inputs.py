"""Random inputs for the op tests."""
from __future__ import annotations

import torch


def padding_mask(batch: int, T: int, left_pad: list[int] | None = None) -> torch.Tensor:
    """(B, T) bool, True for real tokens; row b has ``left_pad[b]`` leading pad positions."""
    mask = torch.ones(batch, T, dtype=torch.bool)
    for b, p in enumerate(left_pad or []):
        mask[b, : min(p, T)] = False
    return mask


def latte_inputs(B: int, H: int, T: int, L: int, D: int, *, dtype=torch.float64, spread: float = 3.0, normalised=True):
    q = torch.randn(B, H, T, L, dtype=dtype)
    q = torch.softmax(q, dim=-1) if normalised else torch.rand(B, H, T, L, dtype=dtype)
    k = torch.randn(B, H, T, L, dtype=dtype) * spread
    v = torch.randn(B, H, T, D, dtype=dtype)
    return q, k, v


def attention_inputs(B=2, Hq=4, Hkv=2, Tq=37, Tk=None, d=8, *, dtype=torch.float64, seed=0, scale=1.0):
    """Softmax-attention q ``(B, Hq, Tq, d)``, k / v ``(B, Hkv, Tk, d)`` (``Tk`` defaults to ``Tq``) from
    a seeded generator; ``scale`` multiplies q and k (larger logits)."""
    g = torch.Generator().manual_seed(seed)
    Tk = Tq if Tk is None else Tk
    q = (torch.randn(B, Hq, Tq, d, generator=g) * scale).to(dtype)
    k = (torch.randn(B, Hkv, Tk, d, generator=g) * scale).to(dtype)
    v = torch.randn(B, Hkv, Tk, d, generator=g).to(dtype)
    return q, k, v
