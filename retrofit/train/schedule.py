"""Learning-rate schedule: linear warmup, then cosine decay (or constant) to a floor."""
from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
          min_lr_ratio: float = 0.0, time_fraction: float = 0.0) -> float:
    """LR of the optimizer update number ``step`` (0-based).

    Warmup: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first update is
    not wasted at LR 0). Cosine: from ``lr`` at ``warmup_steps`` down to ``min_lr_ratio * lr`` at
    ``total_steps`` (and held there after). A pure function of the step, so a resumed run needs
    no scheduler state to continue on the same curve.

    ``time_fraction``: the share of a time budget (``train.max_time``) already spent; the cosine
    then advances by whichever of the step count and the clock is further along, so a run cut by
    its budget still ends at the floor. Such a run's curve depends on its speed.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span, time_fraction))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
