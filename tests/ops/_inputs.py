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
