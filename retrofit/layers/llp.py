"""LLP (Long-LoRA-inspired PerceiverAR) as a drop-in replacement for a pretrained attention
module (``--method llp``, option ``segment``, default 512).

Each query attends causally to its own half-segment of ``segment / 2`` tokens and to all of the
previous half-segment (``retrofit.ops.llp``); the first half-segment sees only itself. As a
retrofit the layer adds **no weights**: q/k/v/o, q/k norms, RoPE (absolute positions, as
pretrained), scaling and Gemma 2 soft-capping are the pretrained ones. Information beyond one
segment travels only across layers (as in LongLoRA's shifted groups), so the model has to
learn to use that; what trains is the recipe's choice. The natural default, as in LongLoRA, is
LoRA on the attention projections (PEFT) plus the norms and embeddings; conversion itself
marks nothing trainable.

Families with natively windowed layers (Gemma 2/3 local layers, Mistral with a window): a
segment longer than the native window lets those layers see distances they were never
trained on. Measured at conversion on Gemma 3 270M (2048 tokens of Moby-Dick, NLL/token;
base 3.30): s = 256: 4.03, s = 512 (= its window): 3.63, s = 1024: 5.32; s = 512 on the
three global layers only: 3.61. Keep ``segment <= native window`` or convert only the global
layers (``layers=``).

Decoding keeps an :class:`~retrofit.ops.llp.LLPState`: the keys/values of the previous and
the current half-segment (at most ``segment - 1`` tokens per row), constant in context length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retrofit.errors import SpecError

from retrofit.layers.cache import RetrofitLayerCache
from retrofit.layers.base import RetrofitAttention
from retrofit.layers.method import MethodConfig, MethodTestSpec, opt, register_method
from retrofit.ops import llp_attention, llp_attention_cached

__all__ = ["LLPAttention", "LLPConfig", "LLPLayerCache", "build_llp"]


@dataclass
class LLPConfig(MethodConfig):
    """Hyper-parameters of an LLP conversion (``retrofit convert --method llp``)."""

    method = "llp"
    # 3-token half-segments: tens of tokens cross many segment boundaries
    test_spec = MethodTestSpec(options={"segment": 6}, anchor="segment-mask")
    segment: int = opt(512, "segment s in tokens: queries see their own half-segment of s/2 and the previous one")

    def check(self) -> None:
        if self.segment < 2 or self.segment % 2:
            raise SpecError(f"segment={self.segment}: LLP needs an even segment length >= 2 (two half-segments)")


DEFAULT_SEGMENT = LLPConfig.segment


class LLPLayerCache(RetrofitLayerCache):
    """LLP's decoding-cache entry: its state is an :class:`~retrofit.ops.LLPState`, the keys/values
    ``(B, Hkv, <= s + padding, d)`` the layer's next query can still see (no generic window buffer).

    Args:
        window: unused (0): the state holds the keys/values.

    Example::

        >>> from retrofit.layers.cache import output_cache
        >>> import torch, retrofit
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> model = retrofit.convert(model, retrofit.ConversionSpec(method="llp", segment=8))
        >>> out = model(torch.randint(0, 64, (1, 10)), use_cache=True)  # its DynamicCache adopts the entry
        >>> entry = output_cache(out).layers[0]
        >>> type(entry).__name__, entry.buffered  # the previous half-segment and the current one
        ('LLPLayerCache', 6)
    """

    @property
    def buffered(self) -> int:
        return 0 if self.state is None else self.state.length



class LLPAttention(RetrofitAttention):
    """Pretrained attention restricted to the LLP overlapping half-segment pattern (no new weights).

    Args:
        original: the pretrained attention module (its projections and norms move into this layer).
        patch: the family patch (:func:`retrofit.patches.get_patch`) that builds q, k, v for it.
        segment: even segment length ``s``: a query sees its own half-segment of ``s / 2`` and the previous one.

    Returns:
        ``(attn_output (B, T, hidden), None)`` for ``hidden_states`` ``(B, T, hidden)``; the call
        is :meth:`RetrofitAttention.forward`'s, shared by every method, with a
        ``position_embeddings`` pair and optionally a 2D padding mask and a cache.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import retrofit
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> from retrofit.layers import LLPAttention
        >>> model = retrofit.convert(model, retrofit.ConversionSpec(method="llp", segment=8))
        >>> attn = model.model.layers[0].self_attn
        >>> assert isinstance(attn, LLPAttention)
        >>> print(attn.extra_repr())
        layer_idx=0, heads=4/4, head_dim=8, segment=8
    """

    method = "llp"
    new_module_names = ()

    def __init__(self, original: nn.Module, patch: Any, *, segment: int = DEFAULT_SEGMENT):
        super().__init__(original, patch)
        segment = int(segment)
        if segment < 2 or segment % 2:
            raise ValueError(f"segment={segment}: LLP needs an even segment length >= 2 (two half-segments)")
        self.segment = segment

    def new_cache_layer(self) -> LLPLayerCache:
        return LLPLayerCache(window=0)

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        kw = dict(scaling=self.scaling, softcap=self.softcap, key_padding_mask=valid)
        if cache is None:
            out = llp_attention(q, k, v, self.segment, **kw)
        else:
            out, state = llp_attention_cached(q, k, v, self.segment, cache.state, **kw)
            cache.store(None, None, None, state, q.shape[2])
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, segment={self.segment}"


# ---------------------------------------------------------------------- method registration
def build_llp(original: nn.Module, patch: Any, spec: Any, layer_idx: int, generator: torch.Generator | None) -> LLPAttention:
    """Method-registry builder: an :class:`LLPAttention` with ``spec.config.segment``."""
    return LLPAttention(original, patch, segment=spec.config.segment)


register_method(
    "llp", build_llp, config=LLPConfig,
    description="LLP: pretrained attention over overlapping half-segments (own + previous half), no new weights",
)
