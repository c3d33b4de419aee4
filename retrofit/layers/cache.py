"""Decoding cache for converted models: memory constant in the context length.

Per converted layer a :class:`RetrofitLayerCache` holds

* the latent state (a :class:`~retrofit.ops.LatteState`: ``m`` ``(B, H, L, D)``, ``z`` ``(B, H, L)``),
* a rolling buffer of the last ``window - 1`` pretrained keys / values ``(B, Hkv, <= w-1, d)``
  (post-RoPE) with their padding flags ``(B, <= w-1)``, which is all the sliding-window branch
  can still see (Macchiato; exp-linear keeps none),
* the last ``conv_size - 1`` latent-branch inputs when the layer has a causal conv,
* the attention-sink keys / values (the first ``n`` real tokens, kept for good) with their
  stream indices and flags, when the layer has sinks,
* the count of tokens seen (positions, ``get_seq_length``).

The window buffer has two layouts. After a prefill it is chronological (``keys``/``values``/
``valid``: the last ``window - 1`` tokens, oldest first), as multi-token calls need it. The first
one-token call moves it into preallocated *slots* ``[n sinks | w ring slots]``
(:meth:`RetrofitLayerCache.enter_slots`): each decoding step then writes its key/value into the ring
slot of the token leaving the window (:meth:`write_slot`) and attends over the slots in place
(:func:`retrofit.ops.slots.slot_attention_step`), with no per-step copy of the window. A later
multi-token call reads the window back in chronological order (:meth:`past_kv`).

Layers left as softmax attention keep the usual transformers layer (growing
``DynamicLayer``, or ``DynamicSlidingWindowLayer`` for natively windowed layers).

How it is wired: a converted layer asks :func:`layer_cache` for its entry. If the model's
forward or ``generate`` built a plain ``DynamicCache`` (they do whenever ``use_cache`` is on),
the still-empty transformers layer at that index is swapped for a ``RetrofitLayerCache``
the first time the converted layer runs, so every cache that reaches a converted model
becomes constant-memory without callers doing anything. :class:`RetrofitCache` builds the
same structure up front (``RetrofitCache(model)``) for callers that want it explicitly.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from retrofit.ops import LatteState

__all__ = ["RetrofitLayerCache", "RetrofitCache", "cache_keyword", "layer_cache", "output_cache"]


def _index(x: torch.Tensor | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return None if x is None else fn(x)


class RetrofitLayerCache(CacheLayerMixin):
    """Recurrent state + rolling key/value window of one converted layer."""

    is_sliding = True  # masks are never sized from it (the "retrofit" mask is the 2D padding mask)
    is_compileable = False
    is_croppable = False

    def __init__(self, window: int = 0, conv_size: int = 0, **kwargs):
        super().__init__()
        self.window = int(window)
        self.conv_size = int(conv_size)
        self.valid: torch.Tensor | None = None  # (B, P) padding flags of the buffered keys
        self.state: LatteState | None = None
        self.conv_tail: torch.Tensor | None = None  # (B, conv_size - 1, hidden)
        self.sinks: tuple[torch.Tensor, ...] | None = None  # (idx (B, n), valid (B, n), k, v (B, Hkv, n, d))
        self.sinks_full = False  # every row has its n sinks: later tokens never become sinks
        self.cumulative_length = 0
        # decoding layout (None while chronological): keys/values (B, Hkv, n + w, d), allowed (B, n + w)
        self.slot_keys: torch.Tensor | None = None
        self.slot_values: torch.Tensor | None = None
        self.slot_allowed: torch.Tensor | None = None
        self.slot_filled = 0  # ring slots written so far (<= window), filled in order before wrapping
        self.slot_next = 0  # the ring slot the next token goes to
        self.sinks_settled = False  # every sink lies before the window: their slot flags are final

    # ------------------------------------------------------------------ converted layers' API
    @property
    def buffered(self) -> int:
        if self.in_slots:
            return min(self.slot_filled, max(self.window - 1, 0))
        return 0 if self.keys is None else self.keys.shape[-2]

    @property
    def has_past(self) -> bool:
        """Whether a window buffer exists (a previous call stored keys), in either layout."""
        return self.in_slots or self.keys is not None

    @property
    def in_slots(self) -> bool:
        return self.slot_keys is not None

    def past_kv(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values, valid)`` of the buffered tokens, oldest first (None before the first call)."""
        if self.in_slots:
            self.leave_slots()
        return self.keys, self.values, self.valid

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
        """Keep the last ``window - 1`` of ``keys``/``values``/``valid`` (past ++ new), the new state."""
        keep = max(self.window - 1, 0)
        if keys is not None:
            self.keys = keys[..., -keep:, :].contiguous() if keep else keys[..., :0, :]
            self.values = values[..., -keep:, :].contiguous() if keep else values[..., :0, :]
            self.valid = valid[:, -keep:].contiguous() if keep else valid[:, :0]
        self.state = state
        self.conv_tail = conv_tail
        if sinks is not None and sinks is not self.sinks:
            self.sinks = tuple(t.detach() for t in sinks)
            self.sinks_full = bool(self.sinks[1].all())  # one check per call until full, then none
        self.cumulative_length += int(num_new)
        if not self.is_initialized:
            ref = keys if keys is not None else state.m
            self.dtype, self.device = ref.dtype, ref.device
            self.is_initialized = True

    def memory_bytes(self) -> int:
        """Bytes held by this layer's tensors (constant once ``window - 1`` tokens were seen)."""
        tensors = [self.keys, self.values, self.valid, self.conv_tail, *(self.sinks or ())]
        tensors += [self.slot_keys, self.slot_values, self.slot_allowed]
        if self.state is not None:
            tensors += [self.state.m, self.state.z]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(
            "a converted (retrofit) layer's cache holds a latent state and a key window; "
            "it is filled by the converted layer itself, not through Cache.update"
        )

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.valid = self.conv_tail = None
        self.state = self.sinks = None
        self.sinks_full = False
        self.cumulative_length = 0
        self.slot_keys = self.slot_values = self.slot_allowed = None
        self.slot_filled = self.slot_next = 0
        self.sinks_settled = False
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a recurrent latent state cannot be rolled back (no assisted/speculative decoding)")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values = _index(self.keys, fn), _index(self.values, fn)
        self.valid, self.conv_tail = _index(self.valid, fn), _index(self.conv_tail, fn)
        if self.state is not None:
            self.state = LatteState(fn(self.state.m), fn(self.state.z))
        if self.sinks is not None:
            self.sinks = tuple(fn(t) for t in self.sinks)
        self.slot_keys, self.slot_values = _index(self.slot_keys, fn), _index(self.slot_values, fn)
        self.slot_allowed = _index(self.slot_allowed, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda x: x[indices, ...])

    def offload(self) -> None:
        pass  # small by construction; stays on device

    def prefetch(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"RetrofitLayerCache(window={self.window}, seen={self.cumulative_length}, buffered={self.buffered})"


def cache_keyword(fn: Callable[..., Any]) -> str:
    """The keyword under which a model's ``forward`` ``fn`` takes a cache: ``cache`` where its
    signature has it (transformers >= 5.24, which deprecates ``past_key_values`` and drops it from
    ``forward`` in 5.40), else ``past_key_values``. ``generate`` takes the same keyword as
    ``forward`` but hides it in ``**kwargs``, so pass ``model.forward`` for it too."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Cache | None:
    """The cache a forward returned: ``out.cache`` (transformers >= 5.24) or ``out.past_key_values``."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def layer_cache(
    cache: Cache | None, layer_idx: int, factory: Callable[[], RetrofitLayerCache]
) -> RetrofitLayerCache | None:
    """The converted layer ``layer_idx``'s entry in ``cache`` (adopting an empty transformers layer)."""
    if cache is None:
        return None
    if not isinstance(cache, Cache):
        raise TypeError(f"past_key_values must be a transformers Cache, got {type(cache).__name__}")
    layers = cache.layers
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        while len(layers) <= layer_idx:
            layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(layers):
        raise ValueError(f"cache has {len(layers)} layers, converted layer {layer_idx} has no entry")
    entry = layers[layer_idx]
    if isinstance(entry, RetrofitLayerCache):
        return entry
    holds_data = getattr(entry, "is_initialized", False) and entry.get_seq_length() > 0
    if holds_data:
        raise ValueError(
            f"cache layer {layer_idx} already holds softmax keys/values ({type(entry).__name__}); "
            "a converted layer needs its own state: start from an empty cache"
        )
    layers[layer_idx] = factory()
    return layers[layer_idx]


class RetrofitCache(DynamicCache):
    """A ``DynamicCache`` whose converted layers are :class:`RetrofitLayerCache` from the start.

    ``RetrofitCache(model)``: converted attention modules (``is_retrofit_attention``) supply
    their layer cache via ``new_cache_layer()``; other layers get what ``DynamicCache`` would.
    """

    def __init__(self, model: nn.Module, offloading: bool = False):
        super().__init__(config=model.config, offloading=offloading)
        for module in model.modules():
            if getattr(module, "is_retrofit_attention", False):
                self.layers[int(module.layer_idx)] = module.new_cache_layer()

    def memory_bytes(self) -> int:
        """Bytes held by all layers' tensors."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, RetrofitLayerCache):
                total += layer.memory_bytes()
            elif getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False):
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total
