"""Mistral (``model_type`` mistral): LLaMA attention; every layer uses ``config.sliding_window`` if set."""
from __future__ import annotations

from torch import nn

from retrofit.patches.base import AttentionPatch


class MistralPatch(AttentionPatch):
    family = "mistral"
    model_types = ("mistral",)
    modeling_module = "transformers.models.mistral.modeling_mistral"
    attention_class_name = "MistralAttention"

    def read_native_window(self, module: nn.Module) -> int | None:
        return getattr(module.config, "sliding_window", None)


PATCH = MistralPatch()
