"""What every family patch knows: how to reach q, k, v, o inside that family's attention module.

A patch never changes the pretrained module; it reads it. Layers (``retrofit.layers``) call the
patch on themselves after surgery, because they keep the pretrained submodules under the same
attribute names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and, for Gemma 3, ``q_norm`` /
``k_norm``), so the same code runs on the original module (for references) and on the new one.

Shapes: ``hidden_states`` ``(B, T, hidden)``; ``position_embeddings`` is the ``(cos, sin)`` pair
the family's decoder layer hands its attention (each ``(B or 1, T, d)``); returned ``q``
``(B, Hq, T, d)``, ``k`` and ``v`` ``(B, Hkv, T, d)``, with q/k norms and RoPE applied.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionSite:
    """One attention module inside a model: ``getattr(parent, attr)`` is the module."""

    layer_idx: int
    parent: nn.Module
    attr: str
    module: nn.Module
    path: str  # dotted name of the attention module inside the model


class AttentionPatch:
    """Base for LLaMA-shaped attention (separate q/k/v/o projections, RoPE from the decoder layer).

    Subclasses set the class attributes and override the hooks where their family differs.
    """

    family: str = ""
    model_types: tuple[str, ...] = ()
    modeling_module: str = ""  # e.g. "transformers.models.llama.modeling_llama"
    attention_class_name: str = ""
    # pretrained submodules a replacement layer must keep under the same names
    submodule_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    # ----------------------------------------------------------------- discovery
    def _modeling(self):
        return importlib.import_module(self.modeling_module)

    @property
    def attention_class(self) -> type[nn.Module]:
        return getattr(self._modeling(), self.attention_class_name)

    @property
    def rotary_fn(self) -> Callable:
        return self._modeling().apply_rotary_pos_emb

    def is_attention(self, module: nn.Module) -> bool:
        """True for the family's attention module and for an already replaced one."""
        return isinstance(module, self.attention_class) or bool(getattr(module, "is_retrofit_attention", False))

    def attention_sites(self, model: nn.Module) -> list[AttentionSite]:
        """Every attention module of the model, ordered by layer index."""
        sites = []
        for parent_name, parent in model.named_modules():
            for attr, child in parent.named_children():
                if self.is_attention(child):
                    path = f"{parent_name}.{attr}" if parent_name else attr
                    sites.append(AttentionSite(int(child.layer_idx), parent, attr, child, path))
        sites.sort(key=lambda s: s.layer_idx)
        return sites

    # ----------------------------------------------------------------- the math
    def num_heads(self, module: nn.Module) -> tuple[int, int]:
        """``(Hq, Hkv)`` of this attention module."""
        cfg = module.config
        return int(cfg.num_attention_heads), int(cfg.num_key_value_heads)

    def head_dim(self, module: nn.Module) -> int:
        return int(module.head_dim)

    def scaling(self, module: nn.Module) -> float:
        """Multiplier of q.k before the softmax (LLaMA: d**-0.5; Gemma 2/3: query_pre_attn_scalar**-0.5)."""
        return float(module.scaling)

    def softcap(self, module: nn.Module) -> float | None:
        """Attention-logit soft-capping (tanh(s / c) * c) or None; only Gemma 2 uses it."""
        if getattr(module, "is_retrofit_attention", False):
            return module.softcap  # read from the original at conversion
        return self.read_softcap(module)

    def native_window(self, module: nn.Module) -> int | None:
        """The pretrained layer's own sliding window (None for full attention)."""
        if getattr(module, "is_retrofit_attention", False):
            return module.native_window
        return self.read_native_window(module)

    # family hooks, called on the pretrained module
    def read_softcap(self, module: nn.Module) -> float | None:
        return None

    def read_native_window(self, module: nn.Module) -> int | None:
        return None

    def normalize_qk(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k norms before RoPE (Gemma 3); identity elsewhere."""
        return q, k

    def project_qkv(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``(B, Hq, T, d)``, k, v ``(B, Hkv, T, d)`` exactly as the family's forward builds them."""
        if position_embeddings is None:
            raise ValueError(f"{self.family} attention needs position_embeddings (cos, sin) from the decoder layer")
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim(module))
        q = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        q, k = self.normalize_qk(module, q, k)
        cos, sin = position_embeddings
        q, k = self.rotary_fn(q, k, cos, sin)
        return q, k, v

    def project_out(self, module: nn.Module, attn: torch.Tensor) -> torch.Tensor:
        """``attn`` ``(B, Hq, T, d)`` -> ``(B, T, hidden)`` through the pretrained o_proj."""
        B, _, T, _ = attn.shape
        return module.o_proj(attn.transpose(1, 2).reshape(B, T, -1).contiguous())

    def submodules(self, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        """The pretrained children to carry over into a replacement (by the same names)."""
        for name in self.submodule_names:
            child = getattr(module, name, None)
            if child is not None:
                yield name, child

    def __repr__(self) -> str:
        return f"{type(self).__name__}(family={self.family!r}, model_types={self.model_types})"
