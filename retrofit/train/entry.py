"""``train(recipe)``: the one entry point for any recipe.

A recipe with ``stages`` runs stage by stage (:mod:`retrofit.train.stages`), any other through
the training loop (:func:`retrofit.train.loop.run_recipe`). It sits above both, so neither
imports the other's caller.
"""
from __future__ import annotations

from typing import Sequence

from retrofit.train.loop import TrainCallback, TrainResult, run_recipe
from retrofit.train.recipe import Recipe
from retrofit.train.stages import train_stages

__all__ = ["train"]


def train(recipe: Recipe, *, callbacks: Sequence[TrainCallback] = ()) -> TrainResult:
    """Run (or resume) the recipe's training, its stages in order if it has any.

    Launch-agnostic: a plain process, ``torchrun`` or ``deepspeed``; ``callbacks`` hook into every
    stage's run. The result is the last stage's, with ``stages`` listing each stage's summary."""
    if recipe.stages:
        return train_stages(recipe, callbacks=callbacks)
    return run_recipe(recipe, callbacks=callbacks)
