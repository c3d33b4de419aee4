"""Common base of the modules that replace a pretrained attention module.

A replacement keeps the pretrained submodules under the SAME attribute names (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``, ...): the objects are moved, not
copied, so pretrained state-dict keys are unchanged and weights stay shared. The family
``patch`` (``retrofit.patches``; passed in, not imported, to keep the arrows one way) is what
knows how to turn hidden states into q, k, v for that family.

Forward contract (what transformers 5.x decoder layers call)::

    forward(hidden_states (B, T, hidden), position_embeddings=(cos, sin), attention_mask=None,
            past_key_values=None, **kwargs) -> (attn_output (B, T, hidden), None)

``attention_mask`` is what the ``"retrofit"`` mask function produces: ``None`` (no padding) or
the 2D bool key padding mask ``(B, past + T)``; a converted layer never needs a T x T mask.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from retrofit.cache import RetrofitLayerCache

__all__ = ["RetrofitAttention"]


class RetrofitAttention(nn.Module):
    """Holds the pretrained projections of one attention layer plus a method's new weights."""

    is_retrofit_attention = True
    method: str = ""
    new_module_names: tuple[str, ...] = ()  # children holding new (trainable) weights

    def __init__(self, original: nn.Module, patch: Any):
        super().__init__()
        self.patch = patch
        self.layer_idx = int(original.layer_idx)
        self.config = original.config
        self.head_dim = patch.head_dim(original)
        self.num_heads, self.num_kv_heads = patch.num_heads(original)
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = patch.scaling(original)
        self.softcap = patch.softcap(original)
        self.native_window = patch.native_window(original)
        self.hidden_size = int(self.config.hidden_size)
        self.is_causal = True
        self.original_class = type(original).__name__
        for name, child in patch.submodules(original):
            self.add_module(name, child)

    # ------------------------------------------------------------------ helpers
    @property
    def _weight_ref(self) -> torch.Tensor:
        return self.q_proj.weight

    def new_parameter_names(self) -> list[str]:
        """Names (relative to this module) of the parameters the method added."""
        return [f"{m}.{n}" for m in self.new_module_names if getattr(self, m, None) is not None
                for n, _ in getattr(self, m).named_parameters()]

    def new_cache_layer(self) -> RetrofitLayerCache:
        """A fresh decoding-cache entry for this layer."""
        raise NotImplementedError

    @staticmethod
    def key_padding(attention_mask: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
        """``(B, num_new)`` bool flags of the new tokens from the 2D mask, or None (no padding)."""
        if attention_mask is None:
            return None
        if isinstance(attention_mask, dict) or attention_mask.ndim != 2:
            raise ValueError(
                "a converted (retrofit) attention layer needs the 2D key padding mask, got "
                f"{getattr(attention_mask, 'shape', type(attention_mask))}: keep the converted model's attention "
                "implementation at 'retrofit' (model.set_attn_implementation('retrofit'))"
            )
        return attention_mask[:, -num_new:].bool()

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, heads={self.num_heads}/{self.num_kv_heads}, head_dim={self.head_dim}"
