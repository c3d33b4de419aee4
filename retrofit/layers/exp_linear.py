"""exp(Q) exp(K)^T causal linear attention over the pretrained projections (no new weights).

    o_t = sum_{s<=t} (phi(q_t) . phi(k_s)) v_s / sum_{s<=t} phi(q_t) . phi(k_s),
    phi(q) = exp(sqrt(c) q),  phi(k) = exp(sqrt(c) k)

RoPE and scaling, the explicit choice made here:

* q and k are exactly what the pretrained layer feeds its softmax: after q/k norms (Gemma 3)
  and after RoPE. Keeping RoPE keeps the pretrained q/k statistics; position then enters
  through the rotated feature values only (the kernel is no longer a function of the
  relative position alone, unlike softmax attention with RoPE).
* the pretrained softmax scaling ``c`` (``d**-0.5``, or ``query_pre_attn_scalar**-0.5`` for
  Gemma 2/3) is split evenly between the two sides, ``sqrt(c)`` each, so that for small
  logits ``phi(q).phi(k) = sum_i exp(sqrt(c) (q_i + k_i))`` has the same overall temperature
  budget as ``exp(c q.k)``.
* Gemma 2 attention-logit soft-capping has no counterpart (there are no q.k logits) and is
  dropped.
* GQA: k and v are repeated over their query group (``repeat_kv_heads``); the state is per
  query head, ``d x D`` (+ a ``d`` log-normaliser), stabilised as in ``retrofit.ops.exp_linear``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retrofit.layers.cache import RetrofitLayerCache
from retrofit.layers.base import RetrofitAttention
from retrofit.layers.method import MethodConfig, MethodTestSpec, check_chunk_size, chunk_size_opt, register_method
from retrofit.ops import exp_linear_attention, exp_linear_attention_step, repeat_kv_heads

__all__ = ["ExpLinearAttention", "ExpLinearConfig", "build_exp_linear"]


@dataclass
class ExpLinearConfig(MethodConfig):
    """Hyper-parameters of an exp-linear conversion (``retrofit convert --method exp-linear``)."""

    method = "exp-linear"
    # 4-token scan chunks; no window or new weights, so no model-level anchor
    test_spec = MethodTestSpec(options={"chunk_size": 4}, lacks={
        "anchor": "no window and no new weights to close: its exact reference is its op's dense one, on the "
                  "layer (tests/methods/test_exp_linear.py)"})
    chunk_size: int = chunk_size_opt()

    def check(self) -> None:
        check_chunk_size(self.chunk_size)


class ExpLinearAttention(RetrofitAttention):
    """Pretrained attention with the softmax kernel replaced by exp feature maps (no new weights).

    Args:
        original: the pretrained attention module (its projections and norms move into this layer).
        patch: the family patch (:func:`retrofit.patches.get_patch`) that builds q, k, v for it.
        chunk_size: chunk length of the chunked linear-attention scan.

    Returns:
        ``(attn_output (B, T, hidden), None)`` from a call (:meth:`RetrofitAttention.forward`).

    Example::

        >>> from retrofit.layers import ExpLinearAttention
        >>> import torch, retrofit
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> model = retrofit.convert(model, retrofit.ConversionSpec(method="exp-linear"))
        >>> model(torch.randint(0, 64, (2, 10))).logits.shape  # (B, T, vocab)
        torch.Size([2, 10, 64])
        >>> isinstance(model.model.layers[0].self_attn, ExpLinearAttention)
        True
    """

    method = "exp-linear"
    new_module_names = ()

    def __init__(self, original: nn.Module, patch: Any, *, chunk_size: int = ExpLinearConfig.chunk_size):
        super().__init__(original, patch)
        self.chunk_size = int(chunk_size)
        self.feature_scale = float(self.scaling) ** 0.5

    def new_cache_layer(self) -> RetrofitLayerCache:
        return RetrofitLayerCache(window=0)

    def features(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-features ``sqrt(c) q``, ``sqrt(c) k`` ``(B, Hq, T, d)`` and values ``(B, Hq, T, D)`` (k, v repeated
        over their query group) from the pretrained ``q`` ``(B, Hq, T, d)``, ``k``, ``v`` ``(B, Hkv, T, d)``."""
        s = self.feature_scale
        return q * s, repeat_kv_heads(k, self.num_heads) * s, repeat_kv_heads(v, self.num_heads)

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        T = q.shape[2]
        q, k, v = self.features(q, k, v)
        if cache is None:
            out, _ = exp_linear_attention(q, k, v, chunk_size=self.chunk_size, key_padding_mask=valid)
        elif T == 1 and cache.state is not None:
            out, state = exp_linear_attention_step(
                q[:, :, 0], k[:, :, 0], v[:, :, 0], cache.state, valid=None if valid is None else valid[:, 0]
            )
            out = out.unsqueeze(2)
            cache.store(None, None, None, state, T)
        else:
            out, state = exp_linear_attention(
                q, k, v, chunk_size=self.chunk_size, key_padding_mask=valid,
                initial_state=cache.state, output_final_state=True,
            )
            cache.store(None, None, None, state, T)
        return out.to(v.dtype)


# ---------------------------------------------------------------------- method registration
def build_exp_linear(original: nn.Module, patch: Any, spec: Any, layer_idx: int,
                     generator: torch.Generator | None) -> ExpLinearAttention:
    """Method-registry builder: an :class:`ExpLinearAttention` from ``spec.config``."""
    return ExpLinearAttention(original, patch, chunk_size=spec.config.chunk_size)


register_method(
    "exp-linear", build_exp_linear, config=ExpLinearConfig,
    description="exp(Q)exp(K)^T linear attention over the pretrained projections (no new weights)",
)
