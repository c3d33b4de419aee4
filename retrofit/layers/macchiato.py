"""Latte Macchiato attention as a drop-in replacement for a pretrained attention module.

    o_t = p(0|t) * SWA_t(q, k, v) + sum_{l=1..L_h} p(l|t) m_{t,l}      then the pretrained o_proj

* SWA_t: the pretrained attention (q/k/v, q/k norms, RoPE, scaling, soft-capping all from the
  family patch) restricted to the last ``window`` tokens (keys ``t - w < s <= t``): the window
  branch of :mod:`retrofit.layers.window`, which the layer subclasses.
* ``p(.|t) = softmax(latent_q(u_t))`` over ``L_h + 1`` states per query head; state 0 is SWA.
* ``m_{t,l}``: causal Latte over the pretrained values (shared across a GQA group) with latent
  key logits ``latent_k(u_s)``.
* ``u = x`` or a short causal depthwise conv of ``x`` (``conv_size > 1``, paper Sec. 2.4).
* ``window_dropout`` (training only, set per step by :mod:`retrofit.train.window_dropout`): each
  sequence, with that probability, has p(0|t) = 0 at every token of this layer, so the latent
  states alone must produce the output ("scheduled sliding-window dropout": without it a hybrid
  learns to lean on the window branch and leave the latent path unused).
* ``sinks > 0``: the SWA state also attends (in the same softmax) to the first ``sinks`` real
  tokens, StreamingLLM's attention sinks (``retrofit.ops.sinks``, the window branch's): pretrained
  global layers put much of their attention on BOS, which a plain window drops.

New weights: ``latent_q`` Linear(hidden, Hq (L_h + 1), bias) and ``latent_k`` Linear(hidden,
Hq L_h, no bias: a per-latent constant would cancel in p(s|l, t)), optional ``conv``.
Initialisation: ``latent_q.weight = 0`` and bias ``[b0, 0, ..., 0]`` per head with
``b0 = log(share / (1 - share) * L_h)``, so ``p(0|t) = share`` exactly for every token at
conversion (``share = 1`` saturates: p(0|t) = 1 in floating point and the layer equals
w-token sliding-window attention); ``latent_k.weight ~ N(0, initializer_range^2)`` breaks the
symmetry between latents; the conv starts as the identity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from retrofit.errors import SpecError
from retrofit.layers.conv import CausalDepthwiseConv
from retrofit.layers.method import (
    DEFAULT_WINDOW, MethodTestSpec, check_chunk_size, chunk_size_opt, opt, register_method,
)
from retrofit.layers.window import (
    SATURATED_LOGIT, WINDOW_SHARE_HELP, WindowAttention, WindowConfig, WindowDecodingBuffers, WindowLayerCache,
    check_window_share, window_config,
)
from retrofit.ops import LatteState, macchiato_slot_step

__all__ = [
    "DEFAULT_INIT_SWA_SHARE", "MacchiatoAttention", "MacchiatoConfig", "MacchiatoDecodingBuffers",
    "MacchiatoLayerCache", "build_macchiato", "swa_bias",
]

# Initial sliding-window share p(0|t) of a fresh layer. Chosen by the ablation in BENCHMARKS.md
# ("Which defaults training chose", scripts/research/swa_share_ablation.py, Gemma 3 270M, 100 steps): 0.9
# starts closest to the base model (held-out loss 4.27 vs 5.96 at 0.5 and 6.95 at 0.25) and is
# still best after training (3.704 vs 3.713 and 3.814). The one constant every default reads
# (MacchiatoConfig's default, re-exported as retrofit.surgery.DEFAULT_INIT_SWA_SHARE).
DEFAULT_INIT_SWA_SHARE = 0.9


@window_config("window", "latents", "init_swa_share", "conv_size", "sinks", "sink_distance", "chunk_size")
class MacchiatoConfig(WindowConfig):
    """Hyper-parameters of a Macchiato conversion (``retrofit convert --method macchiato``): the window's
    (:class:`~retrofit.layers.window.WindowConfig`) and the latent states'."""

    method = "macchiato"
    capabilities = frozenset({"window_dropout"})
    # a 6-token window with 2 sinks beside 8 latents (2 per head) and a conv, in 4-token scan chunks
    test_spec = MethodTestSpec(options={"window": 6, "sinks": 2, "latents": 8, "conv_size": 2, "chunk_size": 4},
                               anchor="closed-window")
    latents: int = opt(128, "latent states L in total over the query heads (L / heads per head)")
    init_swa_share: float = opt(DEFAULT_INIT_SWA_SHARE, WINDOW_SHARE_HELP)
    conv_size: int = opt(0, "causal depthwise conv size before the latent projections (0 or 1 = none)")
    chunk_size: int = chunk_size_opt()

    def check(self) -> None:
        super().check()
        check_window_share(self.init_swa_share)
        check_chunk_size(self.chunk_size)
        if self.latents < 0:
            raise SpecError(f"latents must be >= 0, got {self.latents}")
        if self.conv_size < 0:
            raise SpecError(f"conv_size must be >= 0 (0 or 1 = no conv), got {self.conv_size}")

    def check_capability(self, capability: str) -> None:
        super().check_capability(capability)
        if capability == "window_dropout" and self.latents == 0:
            raise SpecError("train.window_dropout needs latent states to carry the output when the window branch "
                            "is dropped; conversion.latents is 0")

    def check_model(self, model_config: Any) -> None:
        """The latents must split evenly over the model's query heads."""
        heads = int(model_config.num_attention_heads)
        if self.latents % heads:
            lo, hi = (self.latents // heads) * heads, (self.latents // heads + 1) * heads
            raise SpecError(
                f"latents={self.latents} does not split over the model's {heads} query heads; "
                f"use a multiple of {heads} (e.g. {f'{lo} or {hi}' if lo else hi})"
            )

    def describe(self) -> str:
        parts = [f"window={self.window}", f"latents={self.latents}", f"init_swa_share={self.init_swa_share}",
                 f"conv_size={self.conv_size}"]
        sinks = [f"sinks={self.sinks}"] + ([f"sink_distance={self.sink_distance}"] if self.sink_distance else [])
        return ", ".join(parts + (sinks if self.sinks else []))


class MacchiatoLayerCache(WindowLayerCache):
    """Macchiato's decoding-cache entry: the window's (:class:`~retrofit.layers.window.WindowLayerCache`:
    the last ``window - 1`` keys/values, the sinks, the decoding slots), the latent state
    (:class:`~retrofit.ops.LatteState`, ``m`` ``(B, H, L, D)``, ``z`` ``(B, H, L)``) as its state, and
    the last ``conv_size - 1`` latent-branch inputs ``conv_tail`` ``(B, conv_size - 1, hidden)`` when
    the layer has a causal conv (the layer sets it each call).

    Args:
        window: the sliding window ``w`` in tokens.
        conv_size: the layer's causal conv size (0: none).

    Example::

        >>> import torch
        >>> from retrofit.layers.macchiato import MacchiatoLayerCache
        >>> k = torch.randn(1, 2, 6, 8)  # (B, Hkv, T, d)
        >>> entry = MacchiatoLayerCache(window=4, conv_size=3)
        >>> entry.store(k, k, torch.ones(1, 6, dtype=torch.bool), None, num_new=6)
        >>> entry.conv_tail = torch.zeros(1, 2, 16)  # (B, conv_size - 1, hidden)
        >>> entry.buffered, entry.memory_bytes()
        (3, 515)
    """

    def __init__(self, window: int = 0, conv_size: int = 0, **kwargs: Any):
        super().__init__(window=window, **kwargs)
        self.conv_size = int(conv_size)
        self.conv_tail: torch.Tensor | None = None  # (B, conv_size - 1, hidden)

    def extra_tensors(self) -> list[torch.Tensor | None]:
        return [self.conv_tail, *super().extra_tensors()]

    def reset(self) -> None:
        self.conv_tail = None
        super().reset()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.conv_tail = None if self.conv_tail is None else fn(self.conv_tail)
        super()._apply(fn)


@dataclass
class MacchiatoDecodingBuffers(WindowDecodingBuffers):
    """Macchiato's compiled-decoding state (:mod:`retrofit.layers.decoding`): the window's slots and
    sinks, the latent state and the conv's previous inputs, each updated in place per step."""

    m: torch.Tensor | None = None  # (B, H, L_h, D) latent value means, or None without latent states
    z: torch.Tensor | None = None  # (B, H, L_h) log-normalisers
    conv_tail: torch.Tensor | None = None  # (B, conv_size - 1, hidden), or None without a conv


def swa_bias(share: float, latents_per_head: int) -> float:
    """State-0 bias that gives ``p(0|t) = share`` when all other mixing logits are 0."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"init_swa_share must be in (0, 1], got {share}")
    if share >= 1.0 or latents_per_head == 0:
        return SATURATED_LOGIT
    return math.log(share / (1.0 - share)) + math.log(latents_per_head)


class MacchiatoAttention(WindowAttention):
    """Pretrained attention as a ``window``-token SWA state (:class:`~retrofit.layers.window.WindowAttention`)
    mixed with ``latents`` latent states.

    Args:
        original: the pretrained attention module (its projections and norms move into this layer).
        patch: the family patch (:func:`retrofit.patches.get_patch`) that builds q, k, v for it.
        window: sliding window ``w`` in tokens (keys ``t - w < s <= t``).
        latents: latent states ``L`` over all query heads, a multiple of the heads (``L_h = L / Hq``).
        init_swa_share: initial ``p(0|t)`` in (0, 1] (1: the latent path starts closed).
        conv_size: causal depthwise conv size on the latent branch's input (0 or 1: none).
        chunk_size: chunk length of the chunkwise-parallel latent scan.
        sinks: attention sinks: the window branch also sees the first ``sinks`` real tokens.
        sink_distance: cap on the RoPE distance to a sink (None: the base's context; 0: no cap).
        generator: seeds the latent key initialisation.

    Returns:
        Called as ``layer(hidden_states (B, T, hidden), position_embeddings=(cos, sin),
        attention_mask=None | (B, past + T), past_key_values=None | Cache)``:
        ``(attn_output (B, T, hidden), None)`` (see :meth:`RetrofitAttention.forward`).

    Example::

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from retrofit.layers import MacchiatoAttention
        >>> from retrofit.patches import get_patch
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> attn = MacchiatoAttention(model.model.layers[0].self_attn, get_patch(model), window=8, latents=8)
        >>> x = torch.randn(1, 12, 32)  # (B, T, hidden)
        >>> attn(x, position_embeddings=model.model.rotary_emb(x, torch.arange(12)[None]))[0].shape
        torch.Size([1, 12, 32])
    """

    method = "macchiato"
    new_module_names = ("latent_q", "latent_k", "conv")

    def __init__(
        self,
        original: nn.Module,
        patch: Any,
        *,
        window: int = DEFAULT_WINDOW,
        latents: int = MacchiatoConfig.latents,
        init_swa_share: float = DEFAULT_INIT_SWA_SHARE,
        conv_size: int = MacchiatoConfig.conv_size,
        chunk_size: int = MacchiatoConfig.chunk_size,
        sinks: int = WindowConfig.sinks,
        sink_distance: int | None = WindowConfig.sink_distance,
        generator: torch.Generator | None = None,
    ):
        super().__init__(original, patch, window=window, sinks=sinks, sink_distance=sink_distance)
        if latents < 0 or latents % self.num_heads:
            raise ValueError(f"latents ({latents}) must be a non-negative multiple of the {self.num_heads} query heads")
        self.latents = int(latents)
        self.latents_per_head = self.latents // self.num_heads
        self.init_swa_share = float(init_swa_share)
        self.conv_size = int(conv_size)
        self.chunk_size = int(chunk_size)
        ref = self._weight_ref
        kw = dict(device=ref.device, dtype=ref.dtype)
        H, Lh = self.num_heads, self.latents_per_head
        self.conv = CausalDepthwiseConv(self.hidden_size, self.conv_size, **kw) if self.conv_size > 1 else None
        self.latent_q = nn.Linear(self.hidden_size, H * (Lh + 1), bias=True, **kw)
        self.latent_k = nn.Linear(self.hidden_size, H * Lh, bias=False, **kw) if Lh else None
        self._fused: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # see _fused_latent_projection
        self.reset_new_parameters(generator)

    @torch.no_grad()
    def reset_new_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initial values described in the module docstring (``generator`` for reproducibility)."""
        H, Lh = self.num_heads, self.latents_per_head
        self.latent_q.weight.zero_()
        bias = torch.zeros(H, Lh + 1)
        bias[:, 0] = swa_bias(self.init_swa_share, Lh)
        self.latent_q.bias.copy_(bias.flatten())
        if self.latent_k is not None:
            std = float(getattr(self.config, "initializer_range", 0.02))
            w = torch.randn(self.latent_k.weight.shape, generator=generator, dtype=torch.float32) * std
            self.latent_k.weight.copy_(w)
        if self.conv is not None:
            self.conv.reset_parameters()

    def new_cache_layer(self) -> MacchiatoLayerCache:
        return MacchiatoLayerCache(window=self.window, conv_size=self.conv_size if self.conv is not None else 0)

    # ------------------------------------------------------------------ forward
    def supports(self, capability: str) -> bool:
        if capability == "window_dropout" and not self.latents_per_head:
            return False  # no latent state to carry the output without the window
        return super().supports(capability)

    def mixing_logits(self, x: torch.Tensor, valid: torch.Tensor | None, tail: torch.Tensor | None):
        """The latent branch's logits for inputs ``x`` ``(B, T, hidden)`` (``valid`` ``(B, T)`` or None;
        ``tail`` the conv's previous inputs or None): ``mix_logits (B, H, T, L_h+1)`` (state 0 the
        window; saturated when the latent path is closed), ``latent_logits (B, H, T, L_h)`` or None,
        and the new conv tail."""
        B, T, _ = x.shape
        H, Lh = self.num_heads, self.latents_per_head
        u, new_tail = x, None
        if self.conv is not None:
            xin = x if valid is None else x * valid[..., None].to(x.dtype)  # padding never leaks in
            u, new_tail = self.conv(xin, tail)
        fused = self._fused_latent_projection() if T == 1 and not torch.is_grad_enabled() else None
        if fused is not None:  # decoding: both projections in one matrix-vector product
            mix, lat = F.linear(u, *fused).split((H * (Lh + 1), H * Lh), dim=-1)
            mix = mix.view(B, T, H, Lh + 1).transpose(1, 2)
            lat = lat.reshape(B, T, H, Lh).transpose(1, 2)
        else:
            mix = self.latent_q(u).view(B, T, H, Lh + 1).transpose(1, 2)
            lat = self.latent_k(u).view(B, T, H, Lh).transpose(1, 2) if self.latent_k is not None else None
        return self.window_share(mix, droppable=bool(Lh)), lat, new_tail

    def _fused_latent_projection(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(weight, bias)`` of latent_q and latent_k stacked, rebuilt whenever either changes
        (their storage or version counter); None when either is wrapped (PEFT) or absent."""
        if type(self.latent_q) is not nn.Linear or type(self.latent_k) is not nn.Linear:
            return None
        if torch.compiler.is_compiling():  # a traced step cannot compare storages; two products there
            return None
        wq, bq, wk = self.latent_q.weight, self.latent_q.bias, self.latent_k.weight
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in (wq, bq, wk))
        if self._fused is None or self._fused[0] != key:
            with torch.no_grad():
                weight = torch.cat([wq, wk], dim=0)
                bias = torch.cat([bq, bq.new_zeros(wk.shape[0])])
            self._fused = (key, weight, bias)
        return self._fused[1], self._fused[2]

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        mix, lat, tail = self.mixing_logits(hidden_states, valid, cache.conv_tail if cache is not None else None)
        out = self.mixed_attention(q, k, v, valid, cache, mix, lat, chunk_size=self.chunk_size)
        if cache is not None:
            cache.conv_tail = tail
        return out

    # ------------------------------------------------------------------ compiled decoding (retrofit.layers.decoding)
    def compiled_decoding_support(self) -> str | None:
        """None: every Macchiato layer has a compiled step."""
        return None

    def init_decoding_buffers(self, entry: MacchiatoLayerCache) -> MacchiatoDecodingBuffers:
        """The window's buffers (:meth:`window_decoding_buffers`), the latent state ``m (B, H, L_h, D)``,
        ``z (B, H, L_h)`` (empty before any token reached it) and the conv tail ``(B, conv_size - 1,
        hidden)``, copied from the prefill's cache ``entry``."""
        window = self.window_decoding_buffers(entry)
        B, D = window.slot_v.shape[0], window.slot_v.shape[-1]
        device = window.slot_k.device
        m = z = None
        if self.latent_k is not None:
            state = entry.state
            if state is None:
                state = LatteState.empty(B, self.num_heads, self.latents_per_head, D, device=device)
            m, z = state.m.clone(), state.z.clone()
        tail = None
        if self.conv is not None:
            tail = entry.conv_tail.clone() if entry.conv_tail is not None else window.slot_k.new_zeros(
                B, self.conv.kernel_size - 1, self.hidden_size)
        return MacchiatoDecodingBuffers(**window.window_fields(), m=m, z=z, conv_tail=tail)

    def decoding_step(self, buffers: MacchiatoDecodingBuffers, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      hidden_states: torch.Tensor, position_embeddings: Any, position: torch.Tensor) -> torch.Tensor:
        """One token through the window's slots (:meth:`decoding_window`) mixed with the latent states
        (:func:`retrofit.ops.macchiato_slot_step`, the eager slot step's arithmetic): ``q (B, Hq, 1, d)``,
        ``k``, ``v`` ``(B, Hkv, 1, .)``, ``hidden_states (B, 1, hidden)`` -> ``(B, Hq, 1, D)``; the latent
        state and the conv tail copied back into ``buffers``."""
        allowed = self.decoding_window(buffers, k, v, position)
        mix, lat, tail = self.mixing_logits(hidden_states, None, buffers.conv_tail)
        state = None if buffers.m is None else LatteState(buffers.m, buffers.z)
        out, state = macchiato_slot_step(q, buffers.slot_k, buffers.slot_v, allowed, v, mix, lat, state,
                                         scaling=self.scaling, softcap=self.softcap)
        if state is not None:
            buffers.m.copy_(state.m)
            buffers.z.copy_(state.z)
        if tail is not None:
            buffers.conv_tail.copy_(tail)
        return out

    def _options_repr(self) -> str:
        return (f", latents={self.latents} ({self.latents_per_head}/head), init_swa_share={self.init_swa_share}, "
                f"conv_size={self.conv_size}")


# ---------------------------------------------------------------------- method registration
def build_macchiato(original: nn.Module, patch: Any, spec: Any, layer_idx: int,
                    generator: torch.Generator | None) -> MacchiatoAttention:
    """Method-registry builder: a :class:`MacchiatoAttention` from ``spec.config`` (resolved window)."""
    c: MacchiatoConfig = spec.config
    return MacchiatoAttention(
        original, patch, **c.window_options(), latents=c.latents, init_swa_share=c.init_swa_share,
        conv_size=c.conv_size, chunk_size=c.chunk_size, generator=generator,
    )


register_method(
    "macchiato", build_macchiato, config=MacchiatoConfig,
    description="Latte Macchiato: pretrained attention as a w-token sliding window + trainable latent states",
)
