"""Distillation switches on a converted model: its frozen pretrained attention is the teacher.

Every converted layer keeps the pretrained q/k/v/o, so the original model is the converted model
with its layers switched back (``"teacher"``), and attention transfer needs no second model
(``"transfer"``). See ``retrofit/layers/base.py`` for what each mode computes.

    with distill_mode(model, "teacher"):
        base_logits = model(ids).logits            # the original model
    with distill_mode(model, "transfer"):
        model.model(ids)                            # hidden states of the original model
        loss = sum(transfer_losses(model))          # each layer vs its original attention
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn

from retrofit.errors import SpecError
from retrofit.layers.base import DEFAULT_TRANSFER_QUERIES, DISTILL_MODES, adapters_off

__all__ = ["converted_modules", "distill_mode", "transfer_losses"]


def converted_modules(model: nn.Module) -> list[nn.Module]:
    """The converted attention modules of ``model`` (through PEFT / DeepSpeed wrappers), by layer."""
    found = [m for m in model.modules() if getattr(m, "is_retrofit_attention", False)]
    return sorted(found, key=lambda m: int(m.layer_idx))


@contextlib.contextmanager
def distill_mode(model: nn.Module, mode: str | None, layers: Iterable[int] | None = None, *,
                 position_weights: torch.Tensor | None = None,
                 queries: int = DEFAULT_TRANSFER_QUERIES) -> Iterator[list[nn.Module]]:
    """Put the converted layers (all, or those in ``layers``) in ``mode`` for the ``with`` block.

    ``position_weights`` ``(B, T)`` (``"transfer"`` only): each position's weight in every layer's
    relative error (None: all alike). ``queries`` (``"weights"``): the query rows per sequence
    whose attention weights each layer compares.

    ``"teacher"`` over the whole model also bypasses its PEFT adapters (:func:`adapters_off`): the
    teacher is the original model even while LoRA trains its projections. (``"transfer"`` layers
    bypass them for their own teacher output only.)"""
    if mode not in DISTILL_MODES:
        raise SpecError(f"distill mode must be one of {DISTILL_MODES}, got {mode!r}")
    modules = converted_modules(model)
    if not modules:
        raise SpecError("the model has no converted layers: distillation needs a converted model "
                        "(convert it first, or set a `conversion` section in the recipe)")
    if layers is not None:
        wanted = set(layers)
        modules = [m for m in modules if int(m.layer_idx) in wanted]
    if position_weights is not None and mode != "transfer":
        raise SpecError(f"position_weights weigh the transfer loss; distill mode {mode!r} has none")
    if queries < 1:
        raise SpecError(f"queries must be >= 1, got {queries}")
    if mode == "weights":
        lacking = sorted({m.method for m in modules if not m.supports("attention_weights")})
        if lacking:
            raise SpecError(f"attention-weights distillation needs layers whose output is an explicit distribution "
                            f"over the keys (method hedgehog); method {', '.join(lacking)} has none: distil it with the "
                            f"attention or kl objective instead")
    before = [(m, m.distill_mode) for m in modules]
    for m in modules:
        m.distill_mode = mode
        m.transfer_loss = None
        m.transfer_position_weights = position_weights
        m.transfer_queries = int(queries)
    try:
        with adapters_off(model) if mode == "teacher" and layers is None else contextlib.nullcontext():
            yield modules
    finally:
        for m, old in before:
            m.distill_mode = old
            m.transfer_loss = None
            m.transfer_position_weights = None


def transfer_losses(model: nn.Module) -> list[torch.Tensor]:
    """The ``transfer_loss`` each converted layer recorded in its last ``"transfer"`` forward."""
    return [m.transfer_loss for m in converted_modules(model) if m.transfer_loss is not None]
