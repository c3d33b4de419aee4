"""Latte Macchiato attention as a drop-in replacement for a pretrained attention module.

    o_t = p(0|t) * SWA_t(q, k, v) + sum_{l=1..L_h} p(l|t) m_{t,l}      then the pretrained o_proj

* SWA_t: the pretrained attention (q/k/v, q/k norms, RoPE, scaling, soft-capping all from the
  family patch) restricted to the last ``window`` tokens (keys ``t - w < s <= t``).
* ``p(.|t) = softmax(latent_q(u_t))`` over ``L_h + 1`` states per query head; state 0 is SWA.
* ``m_{t,l}``: causal Latte over the pretrained values (shared across a GQA group) with latent
  key logits ``latent_k(u_s)``.
* ``u = x`` or a short causal depthwise conv of ``x`` (``conv_size > 1``, paper Sec. 2.4).
* ``window_dropout`` (training only, set per step by :mod:`retrofit.train.window_dropout`): each
  sequence, with that probability, has p(0|t) = 0 at every token of this layer, so the latent
  states alone must produce the output ("scheduled sliding-window dropout": without it a hybrid
  learns to lean on the window branch and leave the latent path unused).
* ``sinks > 0``: the SWA state also attends (in the same softmax) to the first ``sinks`` real
  tokens, StreamingLLM's attention sinks (``retrofit.ops.sinks``): pretrained global layers put
  much of their attention on BOS, which a plain window drops.

New weights: ``latent_q`` Linear(hidden, Hq (L_h + 1), bias) and ``latent_k`` Linear(hidden,
Hq L_h, no bias: a per-latent constant would cancel in p(s|l, t)), optional ``conv``.
Initialisation: ``latent_q.weight = 0`` and bias ``[b0, 0, ..., 0]`` per head with
``b0 = log(share / (1 - share) * L_h)``, so ``p(0|t) = share`` exactly for every token at
conversion (``share = 1`` saturates: p(0|t) = 1 in floating point and the layer equals
w-token sliding-window attention); ``latent_k.weight ~ N(0, initializer_range^2)`` breaks the
symmetry between latents; the conv starts as the identity.
"""
from __future__ import annotations

import dataclasses

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from retrofit.errors import SpecError
from retrofit.layers.base import RetrofitAttention
from retrofit.layers.cache import RetrofitLayerCache
from retrofit.layers.conv import CausalDepthwiseConv
from retrofit.layers.method import DEFAULT_WINDOW, MethodConfig, opt, register_method, resolve_window
from retrofit.ops import LatteState, capped_sink_keys, capped_sinks, first_valid, macchiato_attention, macchiato_slot_step

__all__ = [
    "DEFAULT_INIT_SWA_SHARE", "MacchiatoAttention", "MacchiatoConfig", "MacchiatoLayerCache", "build_macchiato", "swa_bias",
]

# Initial sliding-window share p(0|t) of a fresh layer. Chosen by the ablation in BENCHMARKS.md
# ("Which defaults training chose", scripts/research/swa_share_ablation.py, Gemma 3 270M, 100 steps): 0.9
# starts closest to the base model (held-out loss 4.27 vs 5.96 at 0.5 and 6.95 at 0.25) and is
# still best after training (3.704 vs 3.713 and 3.814). The one constant every default reads
# (MacchiatoConfig's default, re-exported as retrofit.surgery.DEFAULT_INIT_SWA_SHARE).
DEFAULT_INIT_SWA_SHARE = 0.9


@dataclass
class MacchiatoConfig(MethodConfig):
    """Hyper-parameters of a Macchiato conversion (``retrofit convert --method macchiato``)."""

    method = "macchiato"
    capabilities = frozenset({"window_dropout"})
    window: int | None = opt(None, f"sliding window w in tokens (default {DEFAULT_WINDOW}, or the family's "
                                   "native window with --layers global)")
    latents: int = opt(128, "latent states L in total over the query heads (L / heads per head)")
    init_swa_share: float = opt(DEFAULT_INIT_SWA_SHARE, "initial sliding-window share p(0|t) in (0, 1] "
                                                        "(1 = latent path closed)")
    conv_size: int = opt(0, "causal depthwise conv size before the latent projections (0 or 1 = none)")
    sinks: int = opt(0, "attention sinks: the window branch also sees the first n tokens")
    sink_distance: int | None = opt(None, "cap on the RoPE distance a query sees to a sink (StreamingLLM-style "
                                          "re-positioning; default the base's max_position_embeddings - 1, so "
                                          "nothing changes inside its context; 0 = no cap)")
    chunk_size: int = opt(64, "chunk length of the chunkwise-parallel scan over the new state")

    def check(self) -> None:
        check_window_options(self)
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
                f"use a multiple of {heads} (e.g. {lo or hi} or {hi})"
            )

    def resolved(self, model_config: Any, layers: Any) -> "MacchiatoConfig":
        return resolved_window_options(self, model_config, layers)

    def describe(self) -> str:
        parts = [f"window={self.window}", f"latents={self.latents}", f"init_swa_share={self.init_swa_share}",
                 f"conv_size={self.conv_size}"]
        sinks = [f"sinks={self.sinks}"] + ([f"sink_distance={self.sink_distance}"] if self.sink_distance else [])
        return ", ".join(parts + (sinks if self.sinks else []))


def window_option_help() -> dict[str, str]:
    """The help text of each of Macchiato's options, for the window branch's options of the
    methods that share it (one text per option, written once in :class:`MacchiatoConfig`)."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(MacchiatoConfig)}


def check_window_options(config: Any) -> None:
    """Range checks of the window branch's options (``window``, ``init_swa_share`` where the config
    has one, ``sinks``, ``sink_distance``, ``chunk_size``), shared by every config with Macchiato's
    window branch."""
    if config.window is not None and config.window < 1:
        raise SpecError(f"window must be >= 1 token, got {config.window}")
    if hasattr(config, "init_swa_share") and not 0.0 < config.init_swa_share <= 1.0:
        raise SpecError(f"init_swa_share must be in (0, 1] (1 = latent path closed), got {config.init_swa_share}")
    if config.sinks < 0:
        raise SpecError(f"sinks must be >= 0 (0 = a plain sliding window), got {config.sinks}")
    if config.chunk_size < 1:
        raise SpecError(f"chunk_size must be >= 1, got {config.chunk_size}")
    if config.sink_distance is not None and config.sink_distance < 0:
        raise SpecError(f"sink_distance must be >= 0 (0 = no cap), got {config.sink_distance}")


def resolved_window_options(config: Any, model_config: Any, layers: Any) -> Any:
    """A copy of ``config`` with its window and its sinks' distance cap made concrete (what a checkpoint records)."""
    import dataclasses

    distance = config.sink_distance
    if distance is None and config.sinks:
        distance = base_context_distance(model_config)
    return dataclasses.replace(config, window=resolve_window(config.window, model_config, layers), sink_distance=distance)


def base_context_distance(model_config: Any) -> int:
    """The farthest RoPE distance the base saw in pretraining (``max_position_embeddings - 1``): the
    sinks' default distance cap."""
    return max(0, int(getattr(model_config, "max_position_embeddings", 0) or 0) - 1)


class MacchiatoLayerCache(RetrofitLayerCache):
    """Macchiato's decoding-cache entry: the latent state (:class:`~retrofit.ops.LatteState`,
    ``m`` ``(B, H, L, D)``, ``z`` ``(B, H, L)``) and the last ``window - 1`` keys/values of the
    generic entry, plus

    * the last ``conv_size - 1`` latent-branch inputs ``(B, conv_size - 1, hidden)`` when the
      layer has a causal conv,
    * the attention-sink keys / values (the first ``n`` real tokens, kept for good) with their
      stream indices and flags, when the layer has sinks.

    The window buffer has two layouts. After a prefill it is chronological (``keys``/``values``/
    ``valid``: the last ``window - 1`` tokens, oldest first), as multi-token calls need it. The
    first one-token call moves it into preallocated *slots* ``[n sinks | w ring slots]``
    (:meth:`enter_slots`): each decoding step then writes its key/value into the ring slot of the
    token leaving the window (:meth:`write_slot`) and attends over the slots in place
    (:func:`retrofit.ops.slots.slot_attention_step`), with no per-step copy of the window. A later
    multi-token call reads the window back in chronological order (:meth:`past_kv`).

    Args:
        window: the sliding window ``w`` in tokens.
        conv_size: the layer's causal conv size (0: none).

    Example::

        >>> import torch
        >>> from retrofit.layers.macchiato import MacchiatoLayerCache
        >>> k = torch.randn(1, 2, 6, 8)  # (B, Hkv, T, d)
        >>> entry = MacchiatoLayerCache(window=4)
        >>> entry.store(k, k, torch.ones(1, 6, dtype=torch.bool), None, num_new=6)
        >>> entry.enter_slots()  # the first decoding step's layout: [sinks | 4 ring slots]
        >>> entry.slot_keys.shape, entry.buffered
        (torch.Size([1, 2, 4, 8]), 3)
    """

    def __init__(self, window: int = 0, conv_size: int = 0, **kwargs: Any):
        super().__init__(window=window, **kwargs)
        self.conv_size = int(conv_size)
        self.conv_tail: torch.Tensor | None = None  # (B, conv_size - 1, hidden)
        self.sinks: tuple[torch.Tensor, ...] | None = None  # (idx (B, n), valid (B, n), k, v (B, Hkv, n, d))
        self.sinks_full = False  # every row has its n sinks: later tokens never become sinks
        # decoding layout (None while chronological): keys/values (B, Hkv, n + w, d), allowed (B, n + w)
        self.slot_keys: torch.Tensor | None = None
        self.slot_values: torch.Tensor | None = None
        self.slot_allowed: torch.Tensor | None = None
        self.slot_filled = 0  # ring slots written so far (<= window), filled in order before wrapping
        self.slot_next = 0  # the ring slot the next token goes to
        self.sinks_settled = False  # every sink lies before the window: their slot flags are final

    @property
    def buffered(self) -> int:
        if self.in_slots:
            return min(self.slot_filled, max(self.window - 1, 0))
        return super().buffered

    @property
    def has_past(self) -> bool:
        """Whether a window buffer exists (a previous call stored keys), in either layout."""
        return self.in_slots or super().has_past

    @property
    def in_slots(self) -> bool:
        return self.slot_keys is not None

    def past_kv(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values, valid)`` of the buffered tokens, oldest first (None before the first call)."""
        if self.in_slots:
            self.leave_slots()
        return super().past_kv()

    def store(
        self,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        valid: torch.Tensor | None,
        state: LatteState | None,
        num_new: int,
        conv_tail: torch.Tensor | None = None,
        sinks: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """The generic :meth:`RetrofitLayerCache.store`, plus the new conv tail and the sinks."""
        self.conv_tail = conv_tail
        if sinks is not None and sinks is not self.sinks:
            self.sinks = tuple(t.detach() for t in sinks)
            self.sinks_full = bool(self.sinks[1].all())  # one check per call until full, then none
        super().store(keys, values, valid, state, num_new)

    # ------------------------------------------------------------------ decoding slots
    def enter_slots(self) -> None:
        """Move the chronological window (and the sinks) into ``[n sinks | w ring slots]``."""
        if self.in_slots:
            return
        if self.keys is None or self.window < 1:
            raise RuntimeError("enter_slots needs a filled window buffer (a prefill first) and window >= 1")
        B, Hkv, P, d = self.keys.shape
        n = 0 if self.sinks is None else self.sinks[2].shape[2]
        w = self.window
        self.slot_keys = self.keys.new_zeros(B, Hkv, n + w, d)
        self.slot_values = self.values.new_zeros(B, Hkv, n + w, self.values.shape[-1])
        self.slot_allowed = torch.zeros(B, n + w, dtype=torch.bool, device=self.keys.device)
        if n:
            self.slot_keys[:, :, :n] = self.sinks[2]
            self.slot_values[:, :, :n] = self.sinks[3]
        self.slot_keys[:, :, n : n + P] = self.keys
        self.slot_values[:, :, n : n + P] = self.values
        self.slot_allowed[:, n : n + P] = self.valid
        self.slot_filled, self.slot_next = P, P % w
        self.keys = self.values = self.valid = None

    def write_slot(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Store the next token's ``key``/``value`` ``(B, Hkv, 1, d)`` and flag ``valid`` ``(B, 1)``
        (None: real) over the oldest ring slot.

        Also flags the sinks this token sees: those before its window (stream index
        ``<= t - window``); one inside the window is its ring slot already.
        """
        n = self.slot_keys.shape[2] - self.window
        i = n + self.slot_next
        self.slot_keys[:, :, i : i + 1] = key
        self.slot_values[:, :, i : i + 1] = value
        self.slot_allowed[:, i : i + 1] = True if valid is None else valid
        if n and not self.sinks_settled:
            first_seen = self.cumulative_length - self.window  # sinks at or before this index are seen
            idx, ok = self.sinks[0], self.sinks[1]
            self.slot_allowed[:, :n] = ok & (idx <= first_seen)
            self.sinks_settled = first_seen >= int(idx.max())
        self.slot_next = (self.slot_next + 1) % self.window
        self.slot_filled = min(self.slot_filled + 1, self.window)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, allowed)`` over the sinks and the filled ring slots (views, no copy)."""
        end = self.slot_keys.shape[2] - self.window + self.slot_filled
        return self.slot_keys[:, :, :end], self.slot_values[:, :, :end], self.slot_allowed[:, :end]

    def advance(self, state: LatteState | None, conv_tail: torch.Tensor | None) -> None:
        """After a slot step: the new latent state and conv tail, one more token seen."""
        self.state = state
        self.conv_tail = conv_tail
        self.cumulative_length += 1

    def leave_slots(self) -> None:
        """Back to the chronological buffer of the last ``window - 1`` tokens."""
        n = self.slot_keys.shape[2] - self.window
        ring = slice(n, n + self.slot_filled)
        k, v, ok = self.slot_keys[:, :, ring], self.slot_values[:, :, ring], self.slot_allowed[:, ring]
        if self.slot_filled == self.window:  # wrapped: the oldest token is at slot_next
            k, v, ok = k.roll(-self.slot_next, 2), v.roll(-self.slot_next, 2), ok.roll(-self.slot_next, 1)
        keep = max(self.window - 1, 0)
        self.keys = k[:, :, k.shape[2] - keep :].contiguous()
        self.values = v[:, :, v.shape[2] - keep :].contiguous()
        self.valid = ok[:, ok.shape[1] - keep :].contiguous()
        self.slot_keys = self.slot_values = self.slot_allowed = None
        self.slot_filled = self.slot_next = 0
        self.sinks_settled = False

    # ------------------------------------------------------------------ RetrofitLayerCache hooks
    def extra_tensors(self) -> list[torch.Tensor | None]:
        return [self.conv_tail, *(self.sinks or ()), self.slot_keys, self.slot_values, self.slot_allowed]

    def reset(self) -> None:
        self.conv_tail = self.sinks = None
        self.sinks_full = False
        self.slot_keys = self.slot_values = self.slot_allowed = None
        self.slot_filled = self.slot_next = 0
        self.sinks_settled = False
        super().reset()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.conv_tail = None if self.conv_tail is None else fn(self.conv_tail)
        if self.sinks is not None:
            self.sinks = tuple(fn(t) for t in self.sinks)
        self.slot_keys, self.slot_values, self.slot_allowed = (
            None if t is None else fn(t) for t in (self.slot_keys, self.slot_values, self.slot_allowed))
        super()._apply(fn)


SATURATED_LOGIT = 1.0e4  # exp(-1e4) underflows to 0 in every float dtype: p(0|t) = 1 exactly


def swa_bias(share: float, latents_per_head: int) -> float:
    """State-0 bias that gives ``p(0|t) = share`` when all other mixing logits are 0."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"init_swa_share must be in (0, 1], got {share}")
    if share >= 1.0 or latents_per_head == 0:
        return SATURATED_LOGIT
    return math.log(share / (1.0 - share)) + math.log(latents_per_head)


class MacchiatoAttention(RetrofitAttention):
    """Pretrained attention as a ``window``-token SWA state mixed with ``latents`` latent states.

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
        sinks: int = MacchiatoConfig.sinks,
        sink_distance: int | None = MacchiatoConfig.sink_distance,
        generator: torch.Generator | None = None,
    ):
        super().__init__(original, patch)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if latents < 0 or latents % self.num_heads:
            raise ValueError(f"latents ({latents}) must be a non-negative multiple of the {self.num_heads} query heads")
        self.window = int(window)
        self.latents = int(latents)
        self.latents_per_head = self.latents // self.num_heads
        self.init_swa_share = float(init_swa_share)
        self.conv_size = int(conv_size)
        self.chunk_size = int(chunk_size)
        self.sinks = int(sinks)
        if sink_distance is None:  # as MacchiatoConfig.resolved: the base's pretraining context
            sink_distance = base_context_distance(self.config)
        self.sink_distance = int(sink_distance)
        # the frequencies that move a sink's key to the capped distance (the base's, fp32); None: uncapped
        self.sink_inv_freq = self.rope_inv_freq if self.sinks and self.sink_distance else None
        if self.sinks and self.sink_distance and self.rope_inv_freq is None:
            warnings.warn(f"layer {self.layer_idx}: this model's RoPE type has no fixed frequencies; "
                          f"the sinks' distance is not capped", stacklevel=2)
        ref = self._weight_ref
        kw = dict(device=ref.device, dtype=ref.dtype)
        H, Lh = self.num_heads, self.latents_per_head
        self.conv = CausalDepthwiseConv(self.hidden_size, self.conv_size, **kw) if self.conv_size > 1 else None
        self.latent_path_closed = False  # True: p(0|t) = 1 (pure w-token SWA), for anchors / probes
        self.slot_decoding = True  # False: decode through the general path (tests compare the two)
        self.window_dropout = 0.0  # training only: P(window branch dropped for a sequence); see _drop_window
        self.window_dropout_generator: torch.Generator | None = None  # CPU generator for those draws
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
        if self.latent_path_closed:
            mix = torch.zeros_like(mix)
            mix[..., 0] = SATURATED_LOGIT
        elif self.training and self.window_dropout > 0.0 and Lh:
            mix = self._drop_window(mix)
        return mix, lat, new_tail

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

    def _drop_window(self, mix: torch.Tensor) -> torch.Tensor:
        """``mix (B, H, T, L_h+1)`` with state 0 at ``-SATURATED_LOGIT`` (p(0|t) = 0 exactly) for each
        sequence drawn with probability ``window_dropout``; the latent weights renormalise among
        themselves. Draws come from ``window_dropout_generator`` (CPU), so a run is reproducible."""
        B = mix.shape[0]
        drop = torch.rand(B, generator=self.window_dropout_generator) < self.window_dropout
        if not bool(drop.any()):
            return mix
        drop = drop.to(mix.device).view(B, 1, 1)
        state0 = torch.where(drop, torch.full_like(mix[..., 0], -SATURATED_LOGIT), mix[..., 0])
        return torch.cat([state0.unsqueeze(-1), mix[..., 1:]], dim=-1)

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        mix, lat, tail = self.mixing_logits(hidden_states, valid, cache.conv_tail if cache is not None else None)
        return self.mixed_attention(q, k, v, valid, cache, mix, lat, tail)

    def mixed_attention(self, q, k, v, valid, cache, mix, lat, tail) -> torch.Tensor:
        """The window (with its sinks) and the latent states mixed by ``mix`` (``mixing_logits``'
        outputs), through the cache's slots when decoding: ``(B, Hq, T, D)``. A state of ``mix``
        beyond the window and the latents (a subclass's own) takes its share of the softmax and
        contributes nothing here."""
        T = q.shape[2]
        if self._takes_slot_step(T, cache):
            return self._slot_step(q, k, v, mix, lat, tail, valid, cache)
        k_all, v_all, valid_all, num_past, sinks, seen, far = self.window_inputs(q, k, v, valid, cache)
        out, state = macchiato_attention(
            q, k_all, v_all, mix, lat, window=self.window, scaling=self.scaling, softcap=self.softcap,
            key_padding_mask=valid_all, chunk_size=self.chunk_size, num_past=num_past, sinks=sinks, q_start=seen,
            far_sinks=far,
            initial_state=cache.state if cache is not None else None, output_final_state=cache is not None,
        )
        if cache is not None:
            cache.store(k_all, v_all, valid_all, state, T, tail, sinks=sinks)
        return out

    def window_inputs(self, q, k, v, valid, cache):
        """What the window branch reads for this call's ``q (B, Hq, T, d)``, ``k``, ``v`` ``(B, Hkv, T, .)``:
        ``(k_all, v_all, valid_all, num_past, sinks, seen, far)``: the cached window keys and values
        before the new ones (``num_past`` of them; ``valid_all`` ``(B, num_past + T)`` or None), the
        sinks as :func:`retrofit.ops.sinks.first_valid` returns them (None without), the stream
        position of the first new token and the sinks' capped scores (None unless capped)."""
        B, T = q.shape[0], q.shape[2]
        if valid is None and cache is not None:
            valid = torch.ones(B, T, dtype=torch.bool, device=q.device)
        k_all, v_all, valid_all, num_past = k, v, valid, 0
        if cache is not None and cache.has_past:
            pk, pv, pvalid = cache.past_kv()
            num_past = pk.shape[-2]
            k_all, v_all = torch.cat([pk, k], dim=-2), torch.cat([pv, v], dim=-2)
            valid_all = torch.cat([pvalid, valid], dim=-1)
        sinks, seen = None, 0
        if self.sinks and cache is not None and cache.sinks_full:  # the first n real tokens are known
            seen, sinks = cache.cumulative_length, cache.sinks
        elif self.sinks:
            seen = cache.cumulative_length if cache is not None else 0
            idx = torch.arange(seen, seen + T, device=q.device).expand(B, T)
            cand = [idx, torch.ones(B, T, dtype=torch.bool, device=q.device) if valid is None else valid, k, v]
            if cache is not None and cache.sinks is not None:
                cand = [torch.cat([a, b], dim=1 if a.dim() == 2 else 2) for a, b in zip(cache.sinks, cand)]
            sinks = first_valid(self.sinks, *cand)
        far = None
        if sinks is not None and self.sink_inv_freq is not None:
            far = capped_sinks(q, sinks[2], sinks[0], seen, self.sink_distance, self.sink_inv_freq)
        return k_all, v_all, valid_all, num_past, sinks, seen, far

    def _takes_slot_step(self, T: int, cache: MacchiatoLayerCache | None) -> bool:
        """Decoding one token after a prefill, with the sinks (if any) all known: the slot path."""
        if T != 1 or cache is None or not cache.has_past or not self.slot_decoding:
            return False
        return not self.sinks or cache.sinks_full

    def slot_window(self, k, v, valid, cache: MacchiatoLayerCache):
        """The new token's key and value written into the cache's slots: ``(keys, values, allowed)`` over
        the sinks and the filled ring slots, the sinks' keys re-positioned to their capped distance."""
        cache.enter_slots()
        cache.write_slot(k, v, valid)
        slot_k, slot_v, allowed = cache.slots()
        t = cache.cumulative_length  # this token's stream index
        if self.sink_inv_freq is not None and cache.sinks is not None and t > self.sink_distance:
            idx, _, sink_k, _ = cache.sinks  # re-positioned per step from the originals, in the sink slots
            slot_k[:, :, : sink_k.shape[2]] = capped_sink_keys(sink_k, idx, t, self.sink_distance, self.sink_inv_freq)
        return slot_k, slot_v, allowed

    def _slot_step(self, q, k, v, mix, lat, tail, valid, cache: MacchiatoLayerCache) -> torch.Tensor:
        """One token through the cache's in-place window slots (no per-step window copies): ``(B, Hq, 1, D)``."""
        slot_k, slot_v, allowed = self.slot_window(k, v, valid, cache)
        out, state = macchiato_slot_step(
            q, slot_k, slot_v, allowed, v, mix, lat, cache.state, valid=valid, scaling=self.scaling, softcap=self.softcap
        )
        cache.advance(state, tail)
        return out

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, window={self.window}, latents={self.latents} "
            f"({self.latents_per_head}/head), init_swa_share={self.init_swa_share}, conv_size={self.conv_size}"
            + self._sinks_repr()
        )

    def _sinks_repr(self) -> str:
        return ((f", sinks={self.sinks}" if self.sinks else "")
                + (f", sink_distance={self.sink_distance}" if self.sinks and self.sink_distance else ""))


# ---------------------------------------------------------------------- method registration
def build_macchiato(original: nn.Module, patch: Any, spec: Any, layer_idx: int,
                    generator: torch.Generator | None) -> MacchiatoAttention:
    """Method-registry builder: a :class:`MacchiatoAttention` from ``spec.config`` (resolved window)."""
    c: MacchiatoConfig = spec.config
    return MacchiatoAttention(
        original, patch, window=c.window if c.window is not None else DEFAULT_WINDOW, latents=c.latents,
        init_swa_share=c.init_swa_share, conv_size=c.conv_size, chunk_size=c.chunk_size, sinks=c.sinks,
        sink_distance=c.sink_distance, generator=generator,
    )


register_method(
    "macchiato", build_macchiato, config=MacchiatoConfig,
    description="Latte Macchiato: pretrained attention as a w-token sliding window + trainable latent states",
)
