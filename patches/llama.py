"""LLaMA 2 / 3 (``model_type`` llama): the reference LLaMA-shaped attention, scaling d**-0.5, no window."""
from __future__ import annotations

from retrofit.patches.base import AttentionPatch


class LlamaPatch(AttentionPatch):
    family = "llama"
    model_types = ("llama",)
    modeling_module = "transformers.models.llama.modeling_llama"
    attention_class_name = "LlamaAttention"


PATCH = LlamaPatch()
