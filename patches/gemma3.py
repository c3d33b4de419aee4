"""Gemma 3 text (``model_type`` gemma3_text): per-head RMS q_norm / k_norm before RoPE, scaling
``query_pre_attn_scalar**-0.5``, 5 local : 1 global layers (``config.layer_types``) with a
different RoPE base per layer type. The decoder (``Gemma3TextModel.forward``) computes one
``(cos, sin)`` per layer type and hands each layer the pair of its own type, so a replacement
layer receives the right RoPE without knowing its type. Gemma 3 applies no logit soft-capping
(its attention forward never passes ``softcap``, whatever ``config.attn_logit_softcapping`` says)."""
from __future__ import annotations

import torch
from torch import nn

from retrofit.patches.base import AttentionPatch


class Gemma3Patch(AttentionPatch):
    family = "gemma3"
    model_types = ("gemma3_text",)
    modeling_module = "transformers.models.gemma3.modeling_gemma3"
    attention_class_name = "Gemma3Attention"
    submodule_names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")

    def normalize_qk(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return module.q_norm(q), module.k_norm(k)

    def read_native_window(self, module: nn.Module) -> int | None:
        return module.sliding_window


PATCH = Gemma3Patch()
