"""What every family patch knows: how to reach q, k, v, o inside that family's attention module.

A family is DATA: one :class:`Family` row (``patches/families.py`` holds the table) says where the
modeling code lives, how q/k/v/o are reached (separate ``q_proj``/``k_proj``/``v_proj`` or one
fused projection split ``[Hq*d, Hkv*d, Hkv*d]``), the window and soft-cap rules, the q/k norms,
whether the family needs BOS and its LoRA targets. :class:`AttentionPatch` turns a row into the
math; a family that truly differs sets ``Family.hooks`` to an AttentionPatch subclass that
overrides a hook.

A patch never changes the pretrained module; it reads it. Layers (``retrofit.layers``) call the
patch on themselves after surgery, because they keep the pretrained submodules under the same
attribute names (``q_proj``, ``k_proj``, ``v_proj`` or ``qkv_proj``, ``o_proj`` and the q/k norms),
so the same code runs on the original module (for references) and on the new one.

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

__all__ = ["AttentionPatch", "AttentionSite", "Family", "WINDOW_RULES"]

# where a pretrained layer's own sliding window is read:
#   "none": never windowed; "config": config.sliding_window on every layer (Mistral, Phi-3);
#   "layer": the attention module's own ``sliding_window`` (per config.layer_types: Qwen2/3, Gemma 2/3)
WINDOW_RULES = ("none", "config", "layer")


@dataclass(frozen=True)
class Family:
    """One row of the family table: everything retrofit needs to know about a model family.

    ``qkv``: three names (separate q, k, v projections) or one name (a fused projection whose
    output is ``[q | k | v]`` of sizes ``[Hq*d, Hkv*d, Hkv*d]``, as Phi-3's ``qkv_proj``).
    """

    name: str
    model_types: tuple[str, ...]
    modeling_module: str  # e.g. "transformers.models.llama.modeling_llama"
    attention_class: str  # e.g. "LlamaAttention"
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    o_proj: str = "o_proj"
    window: str = "none"  # one of WINDOW_RULES
    softcap_attr: str | None = None  # attribute of the attention module holding the logit soft-cap
    qk_norms: tuple[str, str] | None = None  # per-head (q_norm, k_norm) applied before RoPE
    needs_bos: bool = False  # quality collapses without BOS (evaluation prepends it)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    hooks: type | None = None  # an AttentionPatch subclass, only where the family truly differs
    wrappers: tuple[str, ...] = ()  # multimodal model_types around this text model (refused with a hint)

    def __post_init__(self) -> None:
        if len(self.qkv) not in (1, 3):
            raise ValueError(f"family {self.name!r}: qkv names 3 separate projections or 1 fused one, got {self.qkv}")
        if self.window not in WINDOW_RULES:
            raise ValueError(f"family {self.name!r}: window rule {self.window!r} is not one of {', '.join(WINDOW_RULES)}")
        if not self.model_types:
            raise ValueError(f"family {self.name!r} names no model_type")

    @property
    def fused_qkv(self) -> bool:
        return len(self.qkv) == 1

    @property
    def submodule_names(self) -> tuple[str, ...]:
        """Pretrained children a replacement layer keeps under the same names."""
        return (*self.qkv, self.o_proj, *(self.qk_norms or ()))

    def patch(self) -> "AttentionPatch":
        """The patch that applies this row (``hooks`` if set, else :class:`AttentionPatch`)."""
        return (self.hooks or AttentionPatch)(self)


@dataclass(frozen=True)
class AttentionSite:
    """One attention module inside a model: ``getattr(parent, attr)`` is the module."""

    layer_idx: int
    parent: nn.Module
    attr: str
    module: nn.Module
    path: str  # dotted name of the attention module inside the model


class AttentionPatch:
    """Applies one :class:`Family` row: LLaMA-shaped attention, RoPE from the decoder layer.

    Subclass it (and name the subclass in ``Family.hooks``) only to override a hook where a
    family's math differs from what the row can say.
    """

    def __init__(self, row: Family):
        self.row = row

    # ----------------------------------------------------------------- the row
    @property
    def family(self) -> str:
        return self.row.name

    @property
    def model_types(self) -> tuple[str, ...]:
        return self.row.model_types

    @property
    def modeling_module(self) -> str:
        return self.row.modeling_module

    @property
    def attention_class_name(self) -> str:
        return self.row.attention_class

    @property
    def submodule_names(self) -> tuple[str, ...]:
        return self.row.submodule_names

    @property
    def needs_bos(self) -> bool:
        return self.row.needs_bos

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return self.row.lora_targets

    # ----------------------------------------------------------------- discovery
    def _modeling(self):
        return importlib.import_module(self.row.modeling_module)

    @property
    def attention_class(self) -> type[nn.Module]:
        return getattr(self._modeling(), self.row.attention_class)

    @property
    def rotary_fn(self) -> Callable:
        # resolved once per patch: a compiled decoding step traces this attribute, not an import
        fn = self.__dict__.get("_rotary_fn")
        if fn is None:
            fn = self.__dict__["_rotary_fn"] = self._modeling().apply_rotary_pos_emb
        return fn

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
        cap = getattr(module, self.row.softcap_attr, None) if self.row.softcap_attr else None
        return float(cap) if cap else None

    def read_native_window(self, module: nn.Module) -> int | None:
        if self.row.window == "config":
            return getattr(module.config, "sliding_window", None)
        if self.row.window == "layer":
            return module.sliding_window
        return None

    def rope_inv_freq(self, module: nn.Module) -> torch.Tensor | None:
        """The RoPE inverse frequencies ``(F,)`` (fp32) this layer's keys were rotated with, as the
        model's rotary embedding computes them from the config (per layer type where the config
        has several, e.g. Gemma 3's global and local bases), on the CPU even while transformers
        builds the model on the meta device (loading); None for a RoPE type whose
        frequencies depend on the sequence (``dynamic``) or that transformers cannot compute here."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = module.config
        params = getattr(config, "rope_parameters", None)
        if not isinstance(params, dict):
            return None
        layer_types = getattr(config, "layer_types", None)
        layer_type = None
        if layer_types and isinstance(params.get(layer_types[module.layer_idx]), dict):
            layer_type = layer_types[module.layer_idx]
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            head_dim = self.head_dim(module)
            dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
            exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
            return 1.0 / (float(params["rope_theta"]) ** exponent)
        if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
            return None
        inv_freq, _scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
        return inv_freq.float()

    def normalize_qk(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k norms before RoPE (Gemma 3, Qwen3); identity elsewhere."""
        if self.row.qk_norms is None:
            return q, k
        q_norm, k_norm = self.row.qk_norms
        return getattr(module, q_norm)(q), getattr(module, k_norm)(k)

    def qkv_split(self, module: nn.Module) -> tuple[int, int, int]:
        """Output sizes ``(Hq*d, Hkv*d, Hkv*d)`` of q, k and v inside a fused projection."""
        hq, hkv = self.num_heads(module)
        d = self.head_dim(module)
        return hq * d, hkv * d, hkv * d

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
        if self.row.fused_qkv:
            qkv = getattr(module, self.row.qkv[0])(hidden_states)
            q, k, v = qkv.split(self.qkv_split(module), dim=-1)
        else:
            q, k, v = (getattr(module, name)(hidden_states) for name in self.row.qkv)
        q, k, v = (x.view(hidden_shape).transpose(1, 2) for x in (q, k, v))
        q, k = self.normalize_qk(module, q, k)
        cos, sin = position_embeddings
        q, k = self.rotary_fn(q, k, cos, sin)
        return q, k, v

    def out_proj(self, module: nn.Module) -> nn.Module:
        """The pretrained output projection (its weight's dtype/device is the layer's)."""
        return getattr(module, self.row.o_proj)

    def project_out(self, module: nn.Module, attn: torch.Tensor) -> torch.Tensor:
        """``attn`` ``(B, Hq, T, d)`` -> ``(B, T, hidden)`` through the pretrained output projection."""
        B, _, T, _ = attn.shape
        return self.out_proj(module)(attn.transpose(1, 2).reshape(B, T, -1).contiguous())

    def submodules(self, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        """The pretrained children to carry over into a replacement (by the same names)."""
        for name in self.submodule_names:
            child = getattr(module, name, None)
            if child is not None:
                yield name, child

    def __repr__(self) -> str:
        return f"{type(self).__name__}(family={self.family!r}, model_types={self.model_types})"
