"""Rotary position re-rotation: move a post-RoPE vector to another position.

RoPE rotates each pair of dimensions ``(i, i + F)`` of a query or key at position ``p`` by the
angle ``p * inv_freq[i]`` (the "rotate_half" layout every supported family uses, ``F =
len(inv_freq)``; dimensions past ``2F`` are not rotated, as in partial-rotary models). A score
then depends only on the distance: ``R(t) q . R(s) k = q . R(s - t) k``. So a vector already
rotated to ``p`` is moved to ``p + delta`` by rotating it once more by ``delta``; the attention
sinks use this to cap the distance a query sees to them (:mod:`retrofit.ops.sinks`).
"""
from __future__ import annotations

import torch

__all__ = ["rope_rotate"]


def rope_rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` ``(..., T, d)`` rotated by ``delta`` positions; ``delta`` broadcasts to ``(..., T)``.

    Angles are formed in float64 (``delta * inv_freq`` reaches 1e5 rad at 128K tokens, where
    fp32 keeps ~1e-2 rad), then cos / sin are cast to ``x``'s dtype.
    """
    F = inv_freq.shape[-1]
    if 2 * F > x.shape[-1]:
        raise ValueError(f"{F} rotary frequencies need head_dim >= {2 * F}, got {x.shape[-1]}")
    angle = delta.to(device=x.device, dtype=torch.float64)[..., None] * inv_freq.to(x.device, torch.float64)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2, rest = x[..., :F], x[..., F : 2 * F], x[..., 2 * F :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
