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

__all__ = ["rope_at", "rope_move", "rope_rotate", "rope_to_origin", "rope_unrotate"]

# (device, frequencies) -> (cos, sin) ``(n, F)`` fp32 of positions 0..n-1, grown by doubling
_ORIGIN_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _rotate_half(y: torch.Tensor) -> torch.Tensor:
    """The families' ``rotate_half``: ``(y1, y2) -> (-y2, y1)`` over the last dimension's halves."""
    half = y.shape[-1] // 2
    return torch.cat([-y[..., half:], y[..., :half]], dim=-1)


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
    back = (y * cos - _rotate_half(y) * sin) / (cos * cos + sin * sin)
    return torch.cat([back, rest], dim=-1) if rest.shape[-1] else back


def rope_at(position: float, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``(2F,)`` float64 of one fixed position, in the families' layout (the ``F``
    frequencies twice, as ``rotate_half`` pairs them): the target of :func:`rope_move`."""
    angle = float(position) * inv_freq.detach().to("cpu", torch.float64)
    angle = torch.cat([angle, angle])
    return angle.cos().to(inv_freq.device), angle.sin().to(inv_freq.device)


def rope_move(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, to: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x``, rotated with the ``cos`` / ``sin`` of its positions, moved to the fixed position ``to``.

    The same as ``rope_rotate(rope_unrotate(x, cos, sin), position, inv_freq)`` in one rotation:
    with ``a = cos^2 + sin^2`` (a RoPE attention scaling folded into cos / sin, squared) the angle
    ``position - p`` has ``cos' = (cos_to cos + sin_to sin) / a`` and ``sin' = (sin_to cos - cos_to
    sin) / a``. A decoding step moves one query and one key this way per layer, so it costs a few
    elementwise products on ``(B, T, d_rot)`` instead of two rotations.

    Args:
        x: ``(B, H, T, d)`` post-RoPE queries or keys.
        cos, sin: ``(B, T, d_rot)`` as the model's rotary embedding returns them.
        to: ``(cos, sin)`` ``(d_rot,)`` of the target position (:func:`rope_at`).

    Returns:
        ``(B, H, T, d)`` in ``x.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops.rope import rope_at, rope_move, rope_rotate, rope_unrotate
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> angle = torch.arange(5)[:, None] * inv_freq
        >>> cos, sin = torch.cat([angle.cos()] * 2, -1)[None], torch.cat([angle.sin()] * 2, -1)[None]
        >>> x = torch.randn(1, 2, 5, 8)
        >>> two = rope_rotate(rope_unrotate(x, cos, sin), torch.tensor(7.0), inv_freq)
        >>> torch.allclose(rope_move(x, cos, sin, rope_at(7, inv_freq)), two, atol=1e-5)
        True
    """
    r = cos.shape[-1]
    wide = torch.promote_types(x.dtype, torch.float32)  # the coefficients in fp32 at least
    to_cos, to_sin = (t.to(cos.device, wide) for t in to)
    cos, sin = cos.to(wide), sin.to(wide)
    a = cos * cos + sin * sin
    c = ((to_cos * cos + to_sin * sin) / a)[:, None].to(x.dtype)
    s = ((to_sin * cos - to_cos * sin) / a)[:, None].to(x.dtype)
    y, rest = x[..., :r], x[..., r:]
    moved = y * c + _rotate_half(y) * s
    return torch.cat([moved, rest], dim=-1) if rest.shape[-1] else moved
