"""Pretrained attention as a sliding window mixed with a trainable gated delta-rule memory.

    o_t = p(0|t) * SWA_t(q, k, v) + p(1|t) * M_t^T q'_t          then the pretrained o_proj

Latte Macchiato's mixture (:mod:`retrofit.layers.macchiato`) with a different state beside the
window: instead of L latent states, each of which averages the values it is given, each query
head keeps a key -> value memory ``M_t`` ``(d, D)`` written by the gated delta rule
(:mod:`retrofit.ops.delta_rule`), which replaces the value stored at a key instead of adding to
it. That is the property associative recall past the window needs: additive states saturate on
it, delta-rule states do not ("What Matters in Linearizing Language Models", 2025, on
SmolLM2-135M itself).

* SWA_t: the pretrained attention restricted to the last ``window`` tokens, with attention sinks
  and their capped distance: the window branch of :mod:`retrofit.layers.window`, as in Macchiato
  (same decoding slots).
* ``p(.|t) = softmax([memory_gate(x_t), 0])`` per query head: state 0 the window, state 1 the
  memory. ``memory_gate.weight = 0`` and its bias ``log(share / (1 - share))`` at conversion, so
  ``p(0|t) = init_swa_share`` exactly (default 0.98, see ``DEFAULT_DELTA_SWA_SHARE``); 1 saturates
  (the layer is the w-token window with sinks).
* The memory's keys and queries are the pretrained post-RoPE ones, through a per-head d x d map
  (identity at conversion), L2-normalised: on them a memory read ``q'.k'`` starts as the
  pretrained (relative-position) score. Values: the pretrained ones, shared across a GQA group.
* Write strength ``beta_t = sigmoid(memory_beta(x_t))`` per head; decay
  ``a_t = sigmoid(memory_decay(x_t))`` per head, its bias set so that a stored value halves
  over ``memory_half_life`` tokens at conversion (0: no decay).

New weights: ``memory_gate``, ``memory_beta``, ``memory_decay`` (each Linear(hidden, Hq)),
``memory_query_map`` and ``memory_key_map`` (Hq maps of d x d).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from retrofit.errors import SpecError
from retrofit.layers.method import (
    DEFAULT_WINDOW, MethodTestSpec, check_chunk_size, chunk_size_opt, opt, register_method,
)
from retrofit.layers.window import (
    SATURATED_LOGIT, WINDOW_SHARE_HELP, WindowAttention, WindowConfig, WindowDecodingBuffers, check_window_share,
    window_config,
)
from retrofit.ops import DeltaState, delta_rule_chunked, delta_rule_step, macchiato_slot_step, repeat_kv_heads

__all__ = ["DEFAULT_DELTA_SWA_SHARE", "DEFAULT_MEMORY_HALF_LIFE", "DeltaAttention", "DeltaConfig",
           "DeltaDecodingBuffers", "HeadwiseLinear", "build_delta"]

# Tokens over which a stored value halves at conversion (the decay gate's bias): past a 1024-token
# window, a key written 4K tokens back is still read at half strength.
DEFAULT_MEMORY_HALF_LIFE = 4096
# The window's initial share. Higher than Macchiato's 0.9: an untrained memory reads values at
# unrelated keys, unnormalised (on SmolLM2-135M its read is 1-3.4x the window output's RMS), so a
# 10% share puts the conversion 0.16 nats/token above its closed twin before training, while at
# 0.98 it starts at the twin; after 344K tokens of transfer 0.98 is level with or below 0.9 at
# every length 1K-32K (BENCHMARKS.md, "SmolLM2-135M"). The cost: on a toy whose untrained memory
# hurts nothing, retrieval past the window is learnt a little later (2 points behind on a copy).
DEFAULT_DELTA_SWA_SHARE = 0.98


@window_config("window", "init_swa_share", "memory_half_life", "sinks", "sink_distance", "chunk_size")
class DeltaConfig(WindowConfig):
    """Hyper-parameters of a window + delta-rule memory conversion (``retrofit convert --method delta``):
    the window's (:class:`~retrofit.layers.window.WindowConfig`) and the memory's."""

    method = "delta"
    capabilities = frozenset({"window_dropout"})
    # a 6-token window with 2 sinks; the memory at a 40% share (the default 98% hides it) with a
    # decay that matters over tens of tokens, in 4-token scan chunks
    test_spec = MethodTestSpec(options={"window": 6, "sinks": 2, "init_swa_share": 0.6, "memory_half_life": 30,
                                        "chunk_size": 4}, anchor="closed-window")
    init_swa_share: float = opt(DEFAULT_DELTA_SWA_SHARE, WINDOW_SHARE_HELP)
    memory_half_life: int = opt(DEFAULT_MEMORY_HALF_LIFE, "tokens over which a stored value halves at conversion "
                                                          "(the decay gate's initial bias; 0 = no decay)")
    chunk_size: int = chunk_size_opt()

    def check(self) -> None:
        super().check()
        check_window_share(self.init_swa_share)
        check_chunk_size(self.chunk_size)
        if self.memory_half_life < 0:
            raise SpecError(f"memory_half_life must be >= 0 tokens (0 = no decay), got {self.memory_half_life}")


class HeadwiseLinear(nn.Module):
    """One ``d x d`` linear map per head, identity at creation: ``(B, H, T, d) -> (B, H, T, d)``."""

    def __init__(self, heads: int, dim: int, **kw: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, dim, dim, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.copy_(torch.eye(self.weight.shape[-1]).expand_as(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.to(x.dtype).transpose(-1, -2)  # (B, H, T, d) @ (H, d, e): one batched product


@dataclass
class DeltaDecodingBuffers(WindowDecodingBuffers):
    """The delta method's compiled-decoding state (:mod:`retrofit.layers.decoding`): the window's slots
    and sinks, and the delta-rule memory, updated in place per step."""

    memory: torch.Tensor  # (B, H, d, D) the memory (fp32 at least)


def decay_bias(half_life: int) -> float:
    """Bias of the decay gate that gives ``sigmoid(bias) ** half_life = 1/2`` (``half_life`` 0: unused)."""
    a = 0.5 ** (1.0 / half_life)
    return math.log(a / (1.0 - a))


class DeltaAttention(WindowAttention):
    """Pretrained attention as a ``window``-token SWA state (:class:`~retrofit.layers.window.WindowAttention`)
    mixed with a gated delta-rule memory.

    Args:
        original: the pretrained attention module (its projections and norms move into this layer).
        patch: the family patch that builds q, k, v for it.
        window: sliding window ``w`` in tokens.
        init_swa_share: initial ``p(0|t)`` in (0, 1] (1: the memory starts closed).
        memory_half_life: tokens over which a stored value halves at conversion (0: no decay gate).
        chunk_size: chunk length of the chunkwise-parallel delta rule.
        sinks, sink_distance: the window branch's attention sinks (:class:`~retrofit.layers.window.WindowAttention`).
        generator: seeds the write-strength initialisation.

    Returns:
        Called as ``layer(hidden_states (B, T, hidden), position_embeddings=(cos, sin),
        attention_mask=None | (B, past + T), past_key_values=None | Cache)``:
        ``(attn_output (B, T, hidden), None)``.

    Example::

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from retrofit.layers import DeltaAttention
        >>> from retrofit.patches import get_patch
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> attn = DeltaAttention(model.model.layers[0].self_attn, get_patch(model), window=8)
        >>> x = torch.randn(1, 12, 32)  # (B, T, hidden)
        >>> attn(x, position_embeddings=model.model.rotary_emb(x, torch.arange(12)[None]))[0].shape
        torch.Size([1, 12, 32])
    """

    method = "delta"
    new_module_names = ("memory_gate", "memory_beta", "memory_decay", "memory_query_map", "memory_key_map")

    def __init__(
        self,
        original: nn.Module,
        patch: Any,
        *,
        window: int = DEFAULT_WINDOW,
        init_swa_share: float = DeltaConfig.init_swa_share,
        memory_half_life: int = DeltaConfig.memory_half_life,
        chunk_size: int = DeltaConfig.chunk_size,
        sinks: int = WindowConfig.sinks,
        sink_distance: int | None = WindowConfig.sink_distance,
        generator: torch.Generator | None = None,
    ):
        super().__init__(original, patch, window=window, sinks=sinks, sink_distance=sink_distance)
        if not 0.0 < init_swa_share <= 1.0:
            raise ValueError(f"init_swa_share must be in (0, 1], got {init_swa_share}")
        self.init_swa_share = float(init_swa_share)  # the window's share comes from memory_gate
        self.memory_half_life = int(memory_half_life)
        self.chunk_size = int(chunk_size)
        kw = dict(device=self._weight_ref.device, dtype=self._weight_ref.dtype)
        H = self.num_heads
        self.memory_gate = nn.Linear(self.hidden_size, H, bias=True, **kw)
        self.memory_beta = nn.Linear(self.hidden_size, H, bias=True, **kw)
        self.memory_decay = nn.Linear(self.hidden_size, H, bias=True, **kw) if self.memory_half_life else None
        self.memory_query_map = HeadwiseLinear(H, self.head_dim, **kw)
        self.memory_key_map = HeadwiseLinear(H, self.head_dim, **kw)
        self.reset_new_parameters(generator)

    @torch.no_grad()
    def reset_new_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initial values described in the module docstring (``generator`` for reproducibility)."""
        self.memory_gate.weight.zero_()
        share = self.init_swa_share
        self.memory_gate.bias.fill_(SATURATED_LOGIT if share >= 1.0 else math.log(share / (1.0 - share)))
        std = float(getattr(self.config, "initializer_range", 0.02))
        self.memory_beta.weight.copy_(torch.randn(self.memory_beta.weight.shape, generator=generator) * std)
        self.memory_beta.bias.zero_()  # beta = 1/2
        if self.memory_decay is not None:
            self.memory_decay.weight.zero_()
            self.memory_decay.bias.fill_(decay_bias(self.memory_half_life))
        self.memory_query_map.reset_parameters()
        self.memory_key_map.reset_parameters()

    def mixing_logits(self, x: torch.Tensor, valid: torch.Tensor | None, tail: torch.Tensor | None):
        """``mix (B, H, T, 2)``: state 0 the window, state 1 the memory (column 0 saturated when the
        memory is closed, -saturated for a sequence whose window is dropped in training); no latent
        logits, no conv tail."""
        gate = self.memory_gate(x).transpose(1, 2)  # (B, H, T)
        mix = torch.stack([gate, torch.zeros_like(gate)], dim=-1)
        return self.window_share(mix), None, None

    def memory_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden_states: torch.Tensor):
        """The memory's inputs for this call's tokens: ``q' (B, Hq, T, d)`` and ``k' (B, Hq, T, d)``
        (mapped, L2-normalised), ``v (B, Hq, T, D)``, write strength ``beta (B, Hq, T)`` and log-decay
        ``g (B, Hq, T)`` fp32 (None without a decay gate), from the pretrained post-RoPE ``q``, ``k``,
        ``v`` and the layer's input ``hidden_states (B, T, hidden)``."""
        H = self.num_heads
        mq = F.normalize(self.memory_query_map(q), dim=-1)
        mk = F.normalize(self.memory_key_map(repeat_kv_heads(k, H)), dim=-1)
        beta = torch.sigmoid(self.memory_beta(hidden_states).float()).transpose(1, 2)
        g = None if self.memory_decay is None else F.logsigmoid(self.memory_decay(hidden_states).float()).transpose(1, 2)
        return mq, mk, repeat_kv_heads(v, H), beta, g

    @staticmethod
    def memory_share(mix: torch.Tensor) -> torch.Tensor:
        """``p(1|t) (B, H, T, 1)`` fp32 from ``mixing_logits``' ``mix (B, H, T, 2)``."""
        return torch.softmax(mix.float(), dim=-1)[..., 1:]

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        previous = cache.state if cache is not None else None
        mix, _, _ = self.mixing_logits(hidden_states, valid, None)
        window_part = self.mixed_attention(q, k, v, valid, cache, mix, chunk_size=self.chunk_size)  # p(0|t) * SWA_t
        if self.latent_path_closed:
            return window_part
        mq, mk, mv, beta, g = self.memory_inputs(q, k, v, hidden_states)
        if q.shape[2] == 1 and cache is not None:
            memory, state = delta_rule_step(mq, mk, mv, beta, g, previous, valid=valid)
        else:
            memory, state = delta_rule_chunked(mq, mk, mv, beta, g, key_padding_mask=valid, initial_state=previous,
                                               output_final_state=cache is not None, chunk_size=self.chunk_size)
        if cache is not None:
            cache.state = state
        return window_part + (self.memory_share(mix) * memory).to(window_part.dtype)

    # ------------------------------------------------------------------ compiled decoding (retrofit.layers.decoding)
    def compiled_decoding_support(self) -> str | None:
        """None: every delta layer has a compiled step."""
        return None

    def init_decoding_buffers(self, entry: Any) -> DeltaDecodingBuffers:
        """The window's buffers (:meth:`window_decoding_buffers`) and the memory ``(B, H, d, D)`` (fp32 at
        least; zeros when the prefill ran with it closed: nothing written yet), copied from the
        prefill's cache ``entry``."""
        window = self.window_decoding_buffers(entry)
        state = entry.state
        B, d, D = window.slot_k.shape[0], window.slot_k.shape[-1], window.slot_v.shape[-1]
        memory = state.memory.clone() if isinstance(state, DeltaState) else torch.zeros(
            B, self.num_heads, d, D, dtype=torch.promote_types(window.slot_v.dtype, torch.float32),
            device=window.slot_k.device)
        return DeltaDecodingBuffers(**window.window_fields(), memory=memory)

    def decoding_step(self, buffers: DeltaDecodingBuffers, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      hidden_states: torch.Tensor, position_embeddings: Any, position: torch.Tensor) -> torch.Tensor:
        """One token as :meth:`attend` decodes it: the window through its slots (:meth:`decoding_window`)
        at its share, plus the memory's read at ``p(1|t)`` (:func:`retrofit.ops.delta_rule_step`, the
        torch kernel itself: no backend lookup in the traced step): ``q (B, Hq, 1, d)``, ``k``, ``v``
        ``(B, Hkv, 1, .)``, ``hidden_states (B, 1, hidden)`` -> ``(B, Hq, 1, D)``; the memory copied
        back into ``buffers``."""
        allowed = self.decoding_window(buffers, k, v, position)
        mix, _, _ = self.mixing_logits(hidden_states, None, None)
        out, _ = macchiato_slot_step(q, buffers.slot_k, buffers.slot_v, allowed, v, mix, None, None,
                                     scaling=self.scaling, softcap=self.softcap)
        if self.latent_path_closed:
            return out
        read, memory = delta_rule_step.torch_kernel(*self.memory_inputs(q, k, v, hidden_states),
                                                    DeltaState(buffers.memory))
        buffers.memory.copy_(memory.memory)
        return out + (self.memory_share(mix) * read).to(out.dtype)

    def _options_repr(self) -> str:
        return f", init_swa_share={self.init_swa_share}, memory_half_life={self.memory_half_life}"


def build_delta(original: nn.Module, patch: Any, spec: Any, layer_idx: int,
                generator: torch.Generator | None) -> DeltaAttention:
    """Method-registry builder: a :class:`DeltaAttention` from ``spec.config`` (resolved window)."""
    c: DeltaConfig = spec.config
    return DeltaAttention(
        original, patch, **c.window_options(), init_swa_share=c.init_swa_share,
        memory_half_life=c.memory_half_life, chunk_size=c.chunk_size, generator=generator,
    )


register_method(
    "delta", build_delta, config=DeltaConfig,
    description="pretrained attention as a w-token sliding window + a trainable gated delta-rule memory",
)
