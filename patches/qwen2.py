"""Qwen2 (``model_type`` qwen2): LLaMA attention with q/k/v biases; sliding window per ``layer_types``."""
from __future__ import annotations

from torch import nn

from retrofit.patches.base import AttentionPatch


class Qwen2Patch(AttentionPatch):
    family = "qwen2"
    model_types = ("qwen2",)
    modeling_module = "transformers.models.qwen2.modeling_qwen2"
    attention_class_name = "Qwen2Attention"

    def read_native_window(self, module: nn.Module) -> int | None:
        return module.sliding_window


PATCH = Qwen2Patch()
