"""Activation checkpointing (recompute each decoder layer in backward) on or off, on every
transformers release the project supports.

Recent transformers releases name it ``activation_checkpointing_enable`` / ``_disable``; older
ones the project supports (5.17, for one) have only ``gradient_checkpointing_enable`` /
``_disable``, the same switch under its older name, which later releases keep. Callers go
through :func:`set_activation_checkpointing`, so neither name is assumed.
"""
from __future__ import annotations

from torch import nn

__all__ = ["set_activation_checkpointing"]


def set_activation_checkpointing(model: nn.Module, on: bool) -> None:
    """Turn activation checkpointing of ``model``'s decoder layers on or off (transformers' own switch)."""
    verb = "enable" if on else "disable"
    switch = (getattr(model, f"activation_checkpointing_{verb}", None)
              or getattr(model, f"gradient_checkpointing_{verb}"))
    switch()
