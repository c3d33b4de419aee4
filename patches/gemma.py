"""Gemma 1 (``model_type`` gemma): LLaMA attention (scaling head_dim**-0.5), GeGLU MLP elsewhere."""
from __future__ import annotations

from retrofit.patches.base import AttentionPatch


class GemmaPatch(AttentionPatch):
    family = "gemma"
    model_types = ("gemma",)
    modeling_module = "transformers.models.gemma.modeling_gemma"
    attention_class_name = "GemmaAttention"


PATCH = GemmaPatch()
