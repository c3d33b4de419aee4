"""Decoding cache for converted models: memory constant in the context length.

Per converted layer a :class:`RetrofitLayerCache` holds what every method shares:

* the method's recurrent state (a dataclass of tensors: :class:`~retrofit.ops.LatteState`,
  :class:`~retrofit.ops.LavoState`, :class:`~retrofit.ops.LLPState`, or a method's own),
* for windowed methods, a chronological buffer of the last ``window - 1`` pretrained keys /
  values ``(B, Hkv, <= w-1, d)`` (post-RoPE, oldest first) with their padding flags
  ``(B, <= w-1)``: all a ``w``-token window can still see (``window = 0`` keeps none),
* the count of tokens seen (positions, ``get_seq_length``).

A method that keeps more defines a subclass next to its layer (the per-method hook): it adds its
fields, lists them in :meth:`RetrofitLayerCache.extra_tensors` and re-indexes them in
:meth:`RetrofitLayerCache._apply`, and the layer's ``new_cache_layer()`` returns it (the window's
attention sinks and decoding slots live in :mod:`retrofit.layers.window`, Macchiato's conv tail in
:mod:`retrofit.layers.macchiato`).

Layers left as softmax attention keep the usual transformers layer (growing
``DynamicLayer``, or ``DynamicSlidingWindowLayer`` for natively windowed layers).

How it is wired: a converted layer asks :func:`layer_cache` for its entry. If the model's
forward or ``generate`` built a plain ``DynamicCache`` (they do whenever ``use_cache`` is on),
the still-empty transformers layer at that index is swapped for the layer's own entry
the first time the converted layer runs, so every cache that reaches a converted model
becomes constant-memory without callers doing anything. :class:`RetrofitCache` builds the
same structure up front (``RetrofitCache(model)``) for callers that want it explicitly.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

__all__ = ["RetrofitLayerCache", "RetrofitCache", "cache_keyword", "layer_cache", "map_state", "output_cache"]


def _index(x: torch.Tensor | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return None if x is None else fn(x)


def map_state(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``state`` (a dataclass of tensors, or None) with ``fn`` applied to each of its tensors."""
    if state is None:
        return None
    return type(state)(**{f.name: _index(getattr(state, f.name), fn) for f in dataclasses.fields(state)})


def _state_tensors(state: Any) -> list[torch.Tensor | None]:
    return [] if state is None else [getattr(state, f.name) for f in dataclasses.fields(state)]


class RetrofitLayerCache(CacheLayerMixin):
    """Recurrent state + rolling key/value window of one converted layer.

    Args:
        window: the layer's sliding window ``w`` in tokens; the last ``w - 1`` keys/values are
            kept (0: no key/value buffer, a purely recurrent method).

    Example::

        >>> import torch
        >>> from retrofit.layers.cache import RetrofitLayerCache
        >>> entry = RetrofitLayerCache(window=4)
        >>> k = torch.randn(1, 2, 6, 8)  # (B, Hkv, T, d)
        >>> entry.store(k, k, torch.ones(1, 6, dtype=torch.bool), None, num_new=6)
        >>> entry.buffered, entry.get_seq_length()
        (3, 6)
    """

    is_sliding = True  # masks are never sized from it (the "retrofit" mask is the 2D padding mask)
    is_compileable = False
    is_croppable = False

    def __init__(self, window: int = 0, **kwargs: Any):
        super().__init__()
        self.window = int(window)
        self.valid: torch.Tensor | None = None  # (B, P) padding flags of the buffered keys
        self.state: Any = None
        self.cumulative_length = 0

    # ------------------------------------------------------------------ converted layers' API
    @property
    def buffered(self) -> int:
        """Tokens in the key/value buffer."""
        return 0 if self.keys is None else self.keys.shape[-2]

    @property
    def has_past(self) -> bool:
        """Whether a window buffer exists (a previous call stored keys)."""
        return self.keys is not None

    def past_kv(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values, valid)`` of the buffered tokens, oldest first (None before the first call)."""
        return self.keys, self.values, self.valid

    def with_past(
        self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """This call's ``keys``/``values`` ``(B, Hkv, T, .)`` after the buffered ones (:meth:`past_kv`):
        ``(keys_all, values_all, valid_all, P)``, ``(B, Hkv, P + T, .)`` and their flags ``(B, P + T)``
        (``valid`` ``(B, T)``, None: every new token is real), ``P`` the buffered tokens (0 before the
        first call)."""
        if valid is None:
            valid = torch.ones(keys.shape[0], keys.shape[-2], dtype=torch.bool, device=keys.device)
        if not self.has_past:
            return keys, values, valid, 0
        pk, pv, pvalid = self.past_kv()
        num_past = pk.shape[-2]
        return torch.cat([pk, keys], dim=-2), torch.cat([pv, values], dim=-2), torch.cat([pvalid, valid], dim=-1), num_past

    def store(
        self,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        valid: torch.Tensor | None,
        state: Any,
        num_new: int,
    ) -> None:
        """Keep the last ``window - 1`` of ``keys``/``values`` ``(B, Hkv, P + T, d)`` and ``valid``
        ``(B, P + T)`` (past ++ new; None: keep no keys), the new ``state``, ``num_new`` more tokens seen."""
        keep = max(self.window - 1, 0)
        if keys is not None:
            self.keys = keys[..., -keep:, :].contiguous() if keep else keys[..., :0, :]
            self.values = values[..., -keep:, :].contiguous() if keep else values[..., :0, :]
            self.valid = valid[:, -keep:].contiguous() if keep else valid[:, :0]
        self.state = state
        self.cumulative_length += int(num_new)
        if not self.is_initialized:
            ref = keys if keys is not None else _state_tensors(state)[0]
            self.dtype, self.device = ref.dtype, ref.device
            self.is_initialized = True

    def extra_tensors(self) -> list[torch.Tensor | None]:
        """A method's own tensors beyond the window and the state (hook for subclasses)."""
        return []

    def memory_bytes(self) -> int:
        """Bytes held by this layer's tensors (constant once ``window - 1`` tokens were seen)."""
        tensors = [self.keys, self.values, self.valid, *self.extra_tensors(), *_state_tensors(self.state)]
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
        """Empty again (subclasses reset their own fields, then call this)."""
        self.keys = self.values = self.valid = None
        self.state = None
        self.cumulative_length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a recurrent latent state cannot be rolled back (no assisted/speculative decoding)")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to every tensor along the batch (subclasses map their own fields, then call this)."""
        self.keys, self.values, self.valid = _index(self.keys, fn), _index(self.values, fn), _index(self.valid, fn)
        self.state = map_state(self.state, fn)

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
        return f"{type(self).__name__}(window={self.window}, seen={self.cumulative_length}, buffered={self.buffered})"


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

    Args:
        model: a (partly) converted model; its config sizes the softmax layers' entries.
        offloading: as ``DynamicCache``'s (softmax layers only; converted entries stay on device).

    Example::

        >>> import torch, retrofit
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from retrofit.layers.cache import RetrofitCache, cache_keyword
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
        >>> model = retrofit.convert(model, retrofit.ConversionSpec(window=8, latents=8, layers=[1]))
        >>> cache = RetrofitCache(model)
        >>> [type(layer).__name__ for layer in cache.layers]
        ['DynamicLayer', 'MacchiatoLayerCache']
        >>> _ = model(torch.randint(0, 64, (1, 20)), **{cache_keyword(model.forward): cache}, use_cache=True)
        >>> cache.get_seq_length(), cache.layers[1].buffered  # the converted layer keeps w - 1 keys
        (20, 7)
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
