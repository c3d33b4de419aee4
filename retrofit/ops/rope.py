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

__all__ = ["rope_rotate", "rope_to_origin", "rope_unrotate"]

# (device, frequencies) -> (cos, sin) ``(n, F)`` fp32 of positions 0..n-1, grown by doubling
_ORIGIN_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE vectors by ``delta`` more positions.

    Angles are formed in float64 (``delta * inv_freq`` reaches 1e5 rad at 128K tokens, where
    fp32 keeps ~1e-2 rad), then cos / sin are cast to ``x``'s dtype.

    Args:
        x: ``(..., T, d)`` queries or keys (``d >= 2F``; dimensions past ``2F`` are not rotated).
        delta: positions to move by, broadcasting to ``(..., T)``.
        inv_freq: ``(F,)`` the layer's rotary frequencies.

    Returns:
        ``(..., T, d)`` in ``x.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import rope_rotate
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> x = torch.randn(1, 2, 5, 8)
        >>> back = rope_rotate(rope_rotate(x, torch.arange(5), inv_freq), -torch.arange(5), inv_freq)
        >>> torch.allclose(back, x, atol=1e-5)
        True
    """
    F = inv_freq.shape[-1]
    if 2 * F > x.shape[-1]:
        raise ValueError(f"{F} rotary frequencies need head_dim >= {2 * F}, got {x.shape[-1]}")
    angle = delta.to(device=x.device, dtype=torch.float64)[..., None] * inv_freq.to(x.device, torch.float64)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2, rest = x[..., :F], x[..., F : 2 * F], x[..., 2 * F :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def rope_to_origin(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` ``(..., n, d)``, post-RoPE at positions ``0..n-1``, rotated back to position 0.

    The same as ``rope_rotate(x, -arange(n), inv_freq)``, with cos / sin read from a table cached
    per device and frequencies (angles formed in float64 once), so a decoding step that needs every
    cached key at position 0 costs a few elementwise products instead of ``n F`` float64 cos / sin.
    float64 inputs take :func:`rope_rotate` (the table is fp32).
    """
    n = x.shape[-2]
    if x.dtype == torch.float64 or n == 0:
        return rope_rotate(x, -torch.arange(n, device=x.device), inv_freq)
    F = inv_freq.shape[-1]
    if 2 * F > x.shape[-1]:
        raise ValueError(f"{F} rotary frequencies need head_dim >= {2 * F}, got {x.shape[-1]}")
    key = (str(x.device), tuple(inv_freq.tolist()))
    cos, sin = _ORIGIN_TABLES.get(key, (None, None))
    if cos is None or cos.shape[0] < n:
        size = max(n, 2 * (cos.shape[0] if cos is not None else 0), 1024)
        angle = torch.arange(size, dtype=torch.float64)[:, None] * inv_freq.to("cpu", torch.float64)
        cos, sin = angle.cos().float().to(x.device), angle.sin().float().to(x.device)
        _ORIGIN_TABLES[key] = (cos, sin)
    c, s = cos[:n].to(x.dtype), sin[:n].to(x.dtype)  # rotation by -p: cos p, -sin p
    x1, x2, rest = x[..., :F], x[..., F : 2 * F], x[..., 2 * F :]
    return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s, rest], dim=-1)


def rope_unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated back to position 0 with the ``cos`` / ``sin`` it was rotated with.

    The inverse of the families' ``x * cos + rotate_half(x) * sin`` whatever the positions (left
    padding, cache offsets): ``(y * cos - rotate_half(y) * sin) / (cos^2 + sin^2)`` (the division
    undoes a RoPE attention scaling folded into cos / sin, as YaRN's). Dimensions past the rotary
    ones (partial rotary) are returned as they are.

    Args:
        x: ``(B, H, T, d)`` post-RoPE queries or keys.
        cos, sin: ``(B, T, d_rot)`` as the model's rotary embedding returns them (``d_rot <= d``).

    Returns:
        ``(B, H, T, d)`` in ``x.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops.rope import rope_rotate, rope_unrotate
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> angle = torch.arange(5)[:, None] * inv_freq
        >>> cos, sin = torch.cat([angle.cos()] * 2, -1)[None], torch.cat([angle.sin()] * 2, -1)[None]
        >>> x = torch.randn(1, 2, 5, 8)
        >>> torch.allclose(rope_unrotate(rope_rotate(x, torch.arange(5), inv_freq), cos, sin), x, atol=1e-5)
        True
    """
    r = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    y, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated_half = torch.cat([-y[..., half:], y[..., :half]], dim=-1)
    back = (y * cos - rotated_half * sin) / (cos * cos + sin * sin)
    return torch.cat([back, rest], dim=-1) if rest.shape[-1] else back
