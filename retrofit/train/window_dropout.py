"""Scheduled sliding-window dropout (``train.window_dropout``) for hybrid layers with a window branch.

A hybrid trained with its sliding-window branch always present learns to lean on it and leaves the
linear (latent) branch nearly unused ("component collapse"; Benfeghoul et al. 2025, "Paying
Attention to Hybrid Attention"). Their remedy: suppress the softmax branch at random during
training. Here, at optimizer step ``s`` of ``S``, every converted layer whose method declares the
``window_dropout`` capability (``MethodConfig.capabilities``; Macchiato with latent states) drops
its window branch (p(0|t) = 0 at every token) for each sequence with probability

    p_s = p0 * max(0, 1 - s / (until * S))

linear from ``p0`` to 0 at fraction ``until`` of the run, so training ends in the regime the model
is evaluated in. The draws are seeded by (seed, rank, step, layer): a resumed run repeats them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from retrofit.surgery.distill import converted_modules

__all__ = ["WINDOW_DROPOUT", "dropout_layers", "set_window_dropout", "window_dropout_at"]

WINDOW_DROPOUT = "window_dropout"  # the capability a method declares to take part


def window_dropout_at(step: int, total_steps: int, p0: float, until: float = 1.0, time_fraction: float = 0.0) -> float:
    """Drop probability for the optimizer update number ``step`` (0-based): linear decay, then 0.

    ``time_fraction``: the share of ``train.max_time`` spent; the decay follows whichever of the
    steps and the clock is further along (as the LR schedule does)."""
    if p0 <= 0.0:
        return 0.0
    progress = max(step / max(1, total_steps), time_fraction)
    return float(p0 * max(0.0, 1.0 - progress / until))


def dropout_layers(model: nn.Module) -> list[nn.Module]:
    """The converted layers with a window branch to drop (``layer.supports("window_dropout")``)."""
    return [m for m in converted_modules(model) if m.supports(WINDOW_DROPOUT)]


def set_window_dropout(layers: Iterable[nn.Module], p: float, *, seed: int = 0, step: int = 0, rank: int = 0) -> None:
    """Set each layer's drop probability ``p`` and a CPU generator seeded by (seed, rank, step, layer)."""
    for m in layers:
        m.window_dropout = float(p)
        m.window_dropout_generator = None
        if p > 0.0:
            key = ((int(seed) * 1_000_003 + int(rank)) * 1_000_033 + int(step)) * 1_009 + int(m.layer_idx)
            m.window_dropout_generator = torch.Generator().manual_seed(key % (2**63))
