"""One decoding step of softmax attention over a fixed set of key slots.

A converted layer's decoding cache keeps its attention sinks and its ``w``-token window in one
preallocated buffer, ``[n sink slots | w ring slots]`` (:class:`retrofit.layers.cache.RetrofitLayerCache`):
the new token overwrites the ring slot of the token that just left the window, so a step
copies one key instead of concatenating and re-slicing the whole window three times. Slot
order carries no meaning (keys are post-RoPE); ``allowed`` says which slots the query sees:
filled, real (not padding) and, for a sink, before the query's window (a sink still inside the
window is already one of the ring slots).

Shapes: q ``(B, Hq, 1, d)``, k ``(B, Hkv, S, d)``, v ``(B, Hkv, S, D)``, allowed ``(B, S)``
bool with at least one True per row (the new token's own slot).
"""
from __future__ import annotations

import torch

__all__ = ["slot_attention_step"]


def slot_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``(B, Hq, 1, D)``: one softmax over the allowed slots, per query head (GQA groups share k/v)."""
    B, Hq, Tq, d = q.shape
    if Tq != 1:
        raise ValueError(f"slot_attention_step takes one query per row, got {Tq}")
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    s = torch.matmul(q.reshape(B, Hkv, group, d), k.transpose(-1, -2))  # (B, Hkv, group, S)
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v).view(B, Hq, 1, v.shape[-1])
