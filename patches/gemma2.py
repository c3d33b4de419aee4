"""Gemma 2 (``model_type`` gemma2): scaling ``query_pre_attn_scalar**-0.5``, attention-logit
soft-capping ``tanh(s / c) * c`` with ``c = config.attn_logit_softcapping``, alternating
sliding-window (``config.sliding_window``) and global layers per ``config.layer_types``."""
from __future__ import annotations

from torch import nn

from retrofit.patches.base import AttentionPatch


class Gemma2Patch(AttentionPatch):
    family = "gemma2"
    model_types = ("gemma2",)
    modeling_module = "transformers.models.gemma2.modeling_gemma2"
    attention_class_name = "Gemma2Attention"

    def read_softcap(self, module: nn.Module) -> float | None:
        cap = module.attn_logit_softcapping
        return float(cap) if cap else None

    def read_native_window(self, module: nn.Module) -> int | None:
        return module.sliding_window


PATCH = Gemma2Patch()
