"""The window branch the window methods are built on: the frozen pretrained attention over the
last ``window`` tokens, plus attention sinks.

    SWA_t = softmax over the keys t - w < s <= t (and the sinks) of the pretrained q . k

* The pretrained attention (q/k/v, q/k norms, RoPE, scaling, soft-capping all from the family
  patch) restricted to the last ``window`` tokens: what the base computes locally, kept frozen.
* ``sinks > 0``: the window also attends (in the same softmax) to the first ``sinks`` real tokens,
  StreamingLLM's attention sinks (:mod:`retrofit.ops.sinks`): pretrained global layers put much of
  their attention on BOS, which a plain window drops. A sink's RoPE distance to its query is
  capped at ``sink_distance`` (default the base's pretraining context), so a sink never sits
  farther from a query than the base ever saw.
* Decoding keeps the last ``window - 1`` keys and values and the sinks
  (:class:`WindowLayerCache`), and a one-token call writes its key into a ring slot and attends
  over the slots in place (:mod:`retrofit.ops.slots`).
* Compiled decoding (:mod:`retrofit.layers.decoding`): the same slots in fixed shapes,
  :class:`WindowDecodingBuffers` (:meth:`WindowAttention.window_decoding_buffers` after a prefill),
  into which :meth:`WindowAttention.decoding_window` writes each token; a window method's buffers
  subclass them and its ``decoding_step`` adds its own state's read.

A method adds what the window does not see beside it, and combines the two in one of two ways:

* by a share: mixing logits with state 0 the window (:meth:`WindowAttention.mixed_attention`,
  ``p(0|t)`` of a softmax over the states; :meth:`WindowAttention.window_share` closes the other
  states or drops the window for training): Macchiato's latent states, the delta method's memory;
* in one normalisation: the window's output with its log-sum-exp
  (:meth:`WindowAttention.window_with_lse`, :meth:`WindowAttention.slot_window_step`), merged with
  another read's unnormalised mass as the full softmax would weigh them: the hedgehog method's
  linear read.

:class:`WindowConfig` declares the window's options once (``window``, ``sinks``,
``sink_distance``); each window method's config subclasses it and adds its own
(:class:`WindowSizeConfig`, the ``window`` alone, for a local window without sinks).
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from retrofit.errors import RetrofitError, SpecError
from retrofit.layers.base import RetrofitAttention
from retrofit.layers.cache import RetrofitLayerCache
from retrofit.layers.decoding import DecodingBuffers
from retrofit.layers.method import DEFAULT_WINDOW, MethodConfig, opt, resolve_window
from retrofit.ops import (
    capped_sink_keys, capped_sinks, first_valid, macchiato_attention, macchiato_slot_step, sink_window_attention,
    sliding_window_attention_with_lse, slot_attention_step,
)

__all__ = [
    "SATURATED_LOGIT", "WINDOW_SHARE_HELP", "WindowAttention", "WindowConfig", "WindowDecodingBuffers",
    "WindowLayerCache", "WindowSizeConfig", "base_context_distance", "check_window_share", "window_config",
]

SATURATED_LOGIT = 1.0e4  # exp(-1e4) underflows to 0 in every float dtype: p(0|t) = 1 exactly

# the help of a method's initial window share (``init_swa_share``; Macchiato's and the delta method's)
WINDOW_SHARE_HELP = "initial sliding-window share p(0|t) in (0, 1] (1 = latent path closed)"


# ---------------------------------------------------------------------- config
@dataclass
class WindowSizeConfig(MethodConfig):
    """The window's size alone, declared once: the base of :class:`WindowConfig` and the config of a
    method whose local window has no sinks (LAVO's).

    ``window: None`` resolves to :data:`~retrofit.layers.method.DEFAULT_WINDOW` (or the family's native
    window with ``layers: global``; :meth:`resolved`, what a checkpoint records)."""

    window: int | None = opt(None, f"sliding window w in tokens (default {DEFAULT_WINDOW}, or the family's "
                                   "native window with --layers global)")

    def check(self) -> None:
        """The window's range; a subclass checks its own fields, then calls this."""
        if self.window is not None and self.window < 1:
            raise SpecError(f"window must be >= 1 token, got {self.window}")

    def resolved(self, model_config: Any, layers: Any) -> "WindowSizeConfig":
        """A copy with the window made concrete (what a checkpoint records)."""
        return dataclasses.replace(self, window=resolve_window(self.window, model_config, layers))

    def window_options(self) -> dict[str, Any]:
        """The window's keywords of the method's layer (``window``; None: the default window)."""
        return {"window": self.window if self.window is not None else DEFAULT_WINDOW}


@dataclass
class WindowConfig(WindowSizeConfig):
    """The window branch's options, declared once for every window method: a method's config
    subclasses it (through :func:`window_config`) and adds its own fields.

    ``window: None`` resolves as :class:`WindowSizeConfig`'s, and ``sink_distance: None`` with sinks
    to the base's context (:meth:`resolved`, what a checkpoint records)."""

    sinks: int = opt(0, "attention sinks: the window branch also sees the first n tokens")
    sink_distance: int | None = opt(None, "cap on the RoPE distance a query sees to a sink (StreamingLLM-style "
                                          "re-positioning; default the base's max_position_embeddings - 1, so "
                                          "nothing changes inside its context; 0 = no cap)")

    def check(self) -> None:
        """The window options' ranges; a subclass checks its own fields, then calls this."""
        super().check()
        if self.sinks < 0:
            raise SpecError(f"sinks must be >= 0 (0 = a plain sliding window), got {self.sinks}")
        if self.sink_distance is not None and self.sink_distance < 0:
            raise SpecError(f"sink_distance must be >= 0 (0 = no cap), got {self.sink_distance}")

    def resolved(self, model_config: Any, layers: Any) -> "WindowConfig":
        """A copy with the window and the sinks' distance cap made concrete (what a checkpoint records)."""
        distance = self.sink_distance
        if distance is None and self.sinks:
            distance = base_context_distance(model_config)
        return dataclasses.replace(super().resolved(model_config, layers), sink_distance=distance)

    def window_options(self) -> dict[str, Any]:
        """The window branch's keywords of :class:`WindowAttention` (``window``, ``sinks``, ``sink_distance``)."""
        return {**super().window_options(), "sinks": self.sinks, "sink_distance": self.sink_distance}

    def __repr__(self) -> str:  # in the order of dataclasses.fields (window_config's), as records list them
        items = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__qualname__}({items})"


def window_config(*order: str) -> Callable[[type], type]:
    """``@dataclass`` for a :class:`WindowConfig` subclass whose fields (the window's and its own)
    are listed with ``order`` first wherever fields are listed (``dataclasses.fields``, ``to_dict``,
    the ``retrofit convert`` flags, recorded recipes, ``repr``), not the window's first: a method
    keeps the order its options always had (``window`` first, its own, the sinks', ``chunk_size``).
    Fields ``order`` leaves out follow in declaration order (where a plain subclass puts them).

    Example::

        >>> from retrofit.layers.method import opt
        >>> @window_config("window", "gain", "sinks", "sink_distance")
        ... class GainConfig(WindowConfig):
        ...     gain: float = opt(1.0, "output gain")
        ...     bias: float = opt(0.0, "output bias")
        >>> GainConfig.field_names()
        ('window', 'gain', 'sinks', 'sink_distance', 'bias')
    """

    def make(cls: type) -> type:
        cls = dataclass(cls, repr=False)  # WindowConfig.__repr__ follows the order set here
        fields = cls.__dataclass_fields__
        names = [f.name for f in dataclasses.fields(cls)]
        if len(set(order)) != len(order) or not set(order) <= set(names):
            raise TypeError(f"window_config of {cls.__name__} names each of its fields at most once: {names}, "
                            f"got {list(order)}")
        # dataclasses.fields() lists __dataclass_fields__ in its order (ClassVar pseudo-fields stay after)
        cls.__dataclass_fields__ = {**{n: fields[n] for n in order},
                                    **{n: f for n, f in fields.items() if n not in order}}
        return cls

    return make


def check_window_share(share: float) -> None:
    """``SpecError`` unless a method's initial window share ``init_swa_share`` is in (0, 1]."""
    if not 0.0 < share <= 1.0:
        raise SpecError(f"init_swa_share must be in (0, 1] (1 = latent path closed), got {share}")


def base_context_distance(model_config: Any) -> int:
    """The farthest RoPE distance the base saw in pretraining (``max_position_embeddings - 1``): the
    sinks' default distance cap."""
    return max(0, int(getattr(model_config, "max_position_embeddings", 0) or 0) - 1)


# ---------------------------------------------------------------------- decoding cache
class WindowLayerCache(RetrofitLayerCache):
    """The window's decoding-cache entry: the method's state and the last ``window - 1`` keys/values
    of the generic entry, plus the attention-sink keys / values (the first ``n`` real tokens, kept
    for good) with their stream indices and flags, when the layer has sinks.

    The window buffer has two layouts. After a prefill it is chronological (``keys``/``values``/
    ``valid``: the last ``window - 1`` tokens, oldest first), as multi-token calls need it. The
    first one-token call moves it into preallocated *slots* ``[n sinks | w ring slots]``
    (:meth:`enter_slots`): each decoding step then writes its key/value into the ring slot of the
    token leaving the window (:meth:`write_slot`) and attends over the slots in place
    (:func:`retrofit.ops.slots.slot_attention_step`), with no per-step copy of the window. A later
    multi-token call reads the window back in chronological order (:meth:`past_kv`).

    Args:
        window: the sliding window ``w`` in tokens.

    Example::

        >>> import torch
        >>> from retrofit.layers.window import WindowLayerCache
        >>> k = torch.randn(1, 2, 6, 8)  # (B, Hkv, T, d)
        >>> entry = WindowLayerCache(window=4)
        >>> entry.store(k, k, torch.ones(1, 6, dtype=torch.bool), None, num_new=6)
        >>> entry.enter_slots()  # the first decoding step's layout: [sinks | 4 ring slots]
        >>> entry.slot_keys.shape, entry.buffered
        (torch.Size([1, 2, 4, 8]), 3)
    """

    def __init__(self, window: int = 0, **kwargs: Any):
        super().__init__(window=window, **kwargs)
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

    @property
    def sink_slots(self) -> int:
        """``n``: the slots before the ring (the sinks), in the decoding layout."""
        return self.slot_keys.shape[2] - self.window

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
        state: Any,
        num_new: int,
        sinks: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """The generic :meth:`RetrofitLayerCache.store`, plus the sinks."""
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
        n = self.sink_slots
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
        end = self.sink_slots + self.slot_filled
        return self.slot_keys[:, :, :end], self.slot_values[:, :, :end], self.slot_allowed[:, :end]

    def advance(self, state: Any) -> None:
        """After a slot step: the method's new state, one more token seen."""
        self.state = state
        self.cumulative_length += 1

    def leave_slots(self) -> None:
        """Back to the chronological buffer of the last ``window - 1`` tokens."""
        n = self.sink_slots
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
        return [*(self.sinks or ()), self.slot_keys, self.slot_values, self.slot_allowed]

    def reset(self) -> None:
        self.sinks = None
        self.sinks_full = False
        self.slot_keys = self.slot_values = self.slot_allowed = None
        self.slot_filled = self.slot_next = 0
        self.sinks_settled = False
        super().reset()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.sinks is not None:
            self.sinks = tuple(fn(t) for t in self.sinks)
        self.slot_keys, self.slot_values, self.slot_allowed = (
            None if t is None else fn(t) for t in (self.slot_keys, self.slot_values, self.slot_allowed))
        super()._apply(fn)


# ---------------------------------------------------------------------- compiled decoding buffers
@dataclass
class WindowDecodingBuffers(DecodingBuffers):
    """The window's part of a layer's compiled-decoding state (:mod:`retrofit.layers.decoding`), in
    fixed shapes: ``[n sink slots | w ring slots]`` of keys and values, the token at stream index
    ``s`` in ring slot ``s % w``, and the sinks' original keys, positions and flags. A window
    method's buffers subclass it and add their own state (:meth:`window_fields` for building one).
    Built by :meth:`WindowAttention.window_decoding_buffers`, moved on by
    :meth:`WindowAttention.decoding_window`."""

    slot_k: torch.Tensor  # (B, Hkv, n + w, d)
    slot_v: torch.Tensor  # (B, Hkv, n + w, D)
    sink_k: torch.Tensor  # (B, Hkv, n, d): the sinks' keys at their own positions (capped per step)
    sink_idx: torch.Tensor  # (B, n) stream positions of the sinks
    sink_ok: torch.Tensor  # (B, n) bool: a real sink

    def window_fields(self) -> dict[str, torch.Tensor]:
        """The window's fields by name (``Subclass(**buffers.window_fields(), own=...)``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(WindowDecodingBuffers)}


# ---------------------------------------------------------------------- layer
class WindowAttention(RetrofitAttention):
    """The frozen pretrained attention over the last ``window`` tokens, with attention sinks: the
    base of the window methods, which add their other states beside it (see the module docstring).
    On its own (no method of its own) the layer is ``window``-token sliding-window attention.

    Args:
        original: the pretrained attention module (its projections and norms move into this layer).
        patch: the family patch (:func:`retrofit.patches.get_patch`) that builds q, k, v for it.
        window: sliding window ``w`` in tokens (keys ``t - w < s <= t``).
        sinks: attention sinks: the window branch also sees the first ``sinks`` real tokens.
        sink_distance: cap on the RoPE distance to a sink (None: the base's context; 0: no cap).

    Returns:
        Called as ``layer(hidden_states (B, T, hidden), position_embeddings=(cos, sin),
        attention_mask=None | (B, past + T), past_key_values=None | Cache)``:
        ``(attn_output (B, T, hidden), None)`` (see :meth:`RetrofitAttention.forward`).

    Example::

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from retrofit.layers.window import WindowAttention
        >>> from retrofit.patches import get_patch
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> attn = WindowAttention(model.model.layers[0].self_attn, get_patch(model), window=8, sinks=2)
        >>> x = torch.randn(1, 12, 32)  # (B, T, hidden)
        >>> pe = model.model.rotary_emb(x, torch.arange(12)[None])
        >>> attn(x, position_embeddings=pe)[0].shape
        torch.Size([1, 12, 32])
        >>> q, k, v = attn.patch.project_qkv(attn, x, pe)  # what a method merges another read with:
        >>> out, lse = attn.window_with_lse(q, *attn.window_inputs(q, k, v, None, None))
        >>> out.shape, lse.shape  # (B, Hq, T, D) and its log-sum-exp (B, Hq, T)
        (torch.Size([1, 4, 12, 8]), torch.Size([1, 4, 12]))
    """

    def __init__(
        self,
        original: nn.Module,
        patch: Any,
        *,
        window: int = DEFAULT_WINDOW,
        sinks: int = WindowConfig.sinks,
        sink_distance: int | None = WindowConfig.sink_distance,
    ):
        super().__init__(original, patch)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self.sinks = int(sinks)
        if sink_distance is None:  # as WindowConfig.resolved: the base's pretraining context
            sink_distance = base_context_distance(self.config)
        self.sink_distance = int(sink_distance)
        # the frequencies that move a sink's key to the capped distance (the base's, fp32); None: uncapped
        self.sink_inv_freq = self.rope_inv_freq if self.sinks and self.sink_distance else None
        if self.sinks and self.sink_distance and self.rope_inv_freq is None:
            warnings.warn(f"layer {self.layer_idx}: this model's RoPE type has no fixed frequencies; "
                          f"the sinks' distance is not capped", stacklevel=3)
        # True: the window alone (p(0|t) = 1: every state beside it closed), for anchors / probes
        self.latent_path_closed = False
        self.slot_decoding = True  # False: decode through the general path (tests compare the two)
        self.window_dropout = 0.0  # training only: P(window branch dropped for a sequence); see _drop_window
        self.window_dropout_generator: torch.Generator | None = None  # CPU generator for those draws

    @property
    def memory_closed(self) -> bool:
        """Whether the states beside the window are closed (``latent_path_closed``)."""
        return self.latent_path_closed

    def new_cache_layer(self) -> WindowLayerCache:
        return WindowLayerCache(window=self.window)

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        """The window alone (a method with states beside it writes its own)."""
        if self._takes_slot_step(q.shape[2], cache):
            out, _ = self.slot_window_step(q, k, v, valid, cache)
            cache.advance(cache.state)
            return out
        k_all, v_all, valid_all, num_past, sinks, seen, far = self.window_inputs(q, k, v, valid, cache)
        out, _ = self.window_with_lse(q, k_all, v_all, valid_all, num_past, sinks, seen, far)
        if cache is not None:
            cache.store(k_all, v_all, valid_all, None, q.shape[2], sinks=sinks)
        return out

    # ------------------------------------------------------------------ the window's inputs
    def window_inputs(self, q, k, v, valid, cache):
        """What the window branch reads for this call's ``q (B, Hq, T, d)``, ``k``, ``v`` ``(B, Hkv, T, .)``:
        ``(k_all, v_all, valid_all, num_past, sinks, seen, far)``: the cached window keys and values
        before the new ones (``num_past`` of them; ``valid_all`` ``(B, num_past + T)`` or None), the
        sinks as :func:`retrofit.ops.sinks.first_valid` returns them (None without), the stream
        position of the first new token and the sinks' capped scores (None unless capped)."""
        B, T = q.shape[0], q.shape[2]
        k_all, v_all, valid_all, num_past = (k, v, valid, 0) if cache is None else cache.with_past(k, v, valid)
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

    # ------------------------------------------------------------------ the window in one normalisation
    def window_with_lse(self, q, k_all, v_all, valid_all, num_past, sinks, seen, far):
        """The window (and sinks) attention over :meth:`window_inputs`' outputs and its log-sum-exp:
        ``(B, Hq, T, D)``, ``(B, Hq, T)`` fp32, for a method that merges another read with it in one
        normalisation (the read's unnormalised mass against ``exp(lse)``)."""
        kw = dict(scaling=self.scaling, softcap=self.softcap, key_padding_mask=valid_all, num_past=num_past)
        if sinks is not None:
            idx, sink_valid, sink_k, sink_v = sinks
            return sink_window_attention(q, k_all, v_all, self.window, sink_k, sink_v, idx, sink_valid, q_start=seen,
                                         far=far, with_lse=True, **kw)
        return sliding_window_attention_with_lse(q, k_all, v_all, self.window, **kw)

    def slot_window_step(self, q, k, v, valid, cache: WindowLayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoding token's window through the cache's slots (:meth:`slot_window`): ``(B, Hq, 1, D)``
        and its log-sum-exp ``(B, Hq, 1)`` fp32. The caller moves the cache on (``cache.advance``)."""
        slot_k, slot_v, allowed = self.slot_window(k, v, valid, cache)
        return slot_attention_step(q, slot_k, slot_v, allowed, scaling=self.scaling, softcap=self.softcap,
                                   with_lse=True)

    # ------------------------------------------------------------------ the window at its share
    def window_share(self, mix: torch.Tensor, droppable: bool = True) -> torch.Tensor:
        """Mixing logits ``mix (B, H, T, S)`` (state 0 the window) as the layer uses them: state 0
        saturated and the others 0 (p(0|t) = 1 exactly) while ``latent_path_closed``; in training
        with ``window_dropout`` (and ``droppable``: states beside the window to carry the output),
        state 0 at ``-SATURATED_LOGIT`` for the sequences drawn (:meth:`_drop_window`)."""
        if self.latent_path_closed:
            mix = torch.zeros_like(mix)
            mix[..., 0] = SATURATED_LOGIT
        elif self.training and self.window_dropout > 0.0 and droppable:
            mix = self._drop_window(mix)
        return mix

    def _drop_window(self, mix: torch.Tensor) -> torch.Tensor:
        """``mix (B, H, T, S)`` with state 0 at ``-SATURATED_LOGIT`` (p(0|t) = 0 exactly) for each
        sequence drawn with probability ``window_dropout``; the other states renormalise among
        themselves. Draws come from ``window_dropout_generator`` (CPU), so a run is reproducible."""
        B = mix.shape[0]
        drop = torch.rand(B, generator=self.window_dropout_generator) < self.window_dropout
        if not bool(drop.any()):
            return mix
        drop = drop.to(mix.device).view(B, 1, 1)
        state0 = torch.where(drop, torch.full_like(mix[..., 0], -SATURATED_LOGIT), mix[..., 0])
        return torch.cat([state0.unsqueeze(-1), mix[..., 1:]], dim=-1)

    def mixed_attention(self, q, k, v, valid, cache, mix, lat=None, *, chunk_size: int) -> torch.Tensor:
        """The window (with its sinks) at its share ``p(0|t) = softmax(mix)[..., 0]``, through the
        cache's slots when decoding: ``(B, Hq, T, D)``, in one kernel
        (:func:`~retrofit.ops.macchiato_attention`, scanning in chunks of ``chunk_size``) with Latte
        latent states when ``lat`` holds their key logits ``(B, H, T, L_h)`` (Macchiato's; their state
        is the cache's). A state of ``mix``
        beyond the window and the latents (a method's own) takes its share of the softmax and
        contributes nothing here: the method adds it."""
        T = q.shape[2]
        if self._takes_slot_step(T, cache):
            slot_k, slot_v, allowed = self.slot_window(k, v, valid, cache)
            out, state = macchiato_slot_step(
                q, slot_k, slot_v, allowed, v, mix, lat, cache.state, valid=valid, scaling=self.scaling,
                softcap=self.softcap,
            )
            cache.advance(state)
            return out
        k_all, v_all, valid_all, num_past, sinks, seen, far = self.window_inputs(q, k, v, valid, cache)
        out, state = macchiato_attention(
            q, k_all, v_all, mix, lat, window=self.window, scaling=self.scaling, softcap=self.softcap,
            key_padding_mask=valid_all, chunk_size=chunk_size, num_past=num_past, sinks=sinks, q_start=seen,
            far_sinks=far,
            initial_state=cache.state if cache is not None else None, output_final_state=cache is not None,
        )
        if cache is not None:
            cache.store(k_all, v_all, valid_all, state, T, sinks=sinks)
        return out

    # ------------------------------------------------------------------ decoding slots
    def _takes_slot_step(self, T: int, cache: WindowLayerCache | None) -> bool:
        """Decoding one token after a prefill, with the sinks (if any) all known: the slot path."""
        if T != 1 or cache is None or not cache.has_past or not self.slot_decoding:
            return False
        return not self.sinks or cache.sinks_full

    def slot_window(self, k, v, valid, cache: WindowLayerCache):
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

    # ------------------------------------------------------------------ compiled decoding (retrofit.layers.decoding)
    def window_decoding_buffers(self, entry: Any) -> WindowDecodingBuffers:
        """The window's compiled-decoding buffers from the cache ``entry`` of a prefill (a
        :class:`WindowLayerCache`): its chronological window moved into the ring slot of each token,
        the sinks into the slots before the ring. A window method's ``init_decoding_buffers`` builds
        its own buffers on these."""
        if not isinstance(entry, WindowLayerCache) or not entry.has_past:
            raise RetrofitError("compiled decoding continues a prefill: every layer needs its window cache entry")
        keys, values, valid = entry.past_kv()  # chronological: the last min(seen, w - 1) tokens
        if valid is not None and not bool(valid.all()):
            raise RetrofitError("compiled decoding takes prompts without padding; decode padded batches eagerly")
        seen, w = entry.cumulative_length, self.window
        B, Hkv, P, d = keys.shape
        n = self.sinks
        if n:
            if entry.sinks is None or not entry.sinks_full:
                raise RetrofitError(f"the prompt is shorter than the layer's {n} attention sinks; decode it eagerly")
            sink_idx, sink_ok, sink_k, sink_v = entry.sinks
        else:
            sink_idx = torch.zeros(B, 0, dtype=torch.long, device=keys.device)
            sink_ok = torch.zeros(B, 0, dtype=torch.bool, device=keys.device)
            sink_k, sink_v = keys[:, :, :0], values[:, :, :0]
        slot_k = keys.new_zeros(B, Hkv, n + w, d)
        slot_v = values.new_zeros(B, Hkv, n + w, values.shape[-1])
        slot_k[:, :, :n], slot_v[:, :, :n] = sink_k, sink_v
        ring = n + torch.arange(seen - P, seen, device=keys.device) % w  # token s sits in ring slot s % w
        slot_k[:, :, ring], slot_v[:, :, ring] = keys, values
        return WindowDecodingBuffers(slot_k, slot_v, sink_k.clone(), sink_idx.clone(), sink_ok.clone())

    def decoding_window(self, buffers: WindowDecodingBuffers, k: torch.Tensor, v: torch.Tensor,
                        position: torch.Tensor) -> torch.Tensor:
        """One compiled decoding step's window: the token's key and value ``(B, Hkv, 1, d | D)`` written
        into its ring slot, the sinks' keys re-positioned to their capped distance from ``position``
        (0-dim long, the token's stream index). Returns which slots it sees, ``allowed (B, n + w)``:
        ring slot ``j`` once a token reached it (``j <= t``), a sink once it lies before the window
        (``idx <= t - w``; a sink inside the window is its ring slot)."""
        t = position
        B = k.shape[0]
        n, w = buffers.sink_k.shape[2], self.window
        slot = (n + t % w).view(1)
        buffers.slot_k.index_copy_(2, slot, k)
        buffers.slot_v.index_copy_(2, slot, v)
        allowed_ring = (torch.arange(w, device=k.device) <= t).expand(B, w)
        if not n:
            return allowed_ring
        sinks_seen = buffers.sink_ok & (buffers.sink_idx <= t - w)
        if self.sink_inv_freq is not None:
            capped = capped_sink_keys(buffers.sink_k, buffers.sink_idx, t, self.sink_distance,
                                      self.sink_inv_freq.to(k.device))
            buffers.slot_k[:, :, :n] = capped.to(buffers.slot_k.dtype)
        return torch.cat([sinks_seen, allowed_ring], dim=1)

    # ------------------------------------------------------------------ repr
    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}{self._options_repr()}{self._sinks_repr()}"

    def _options_repr(self) -> str:
        """The method's own options in :meth:`extra_repr`, between the window and the sinks (``", a=1"``)."""
        return ""

    def _sinks_repr(self) -> str:
        return ((f", sinks={self.sinks}" if self.sinks else "")
                + (f", sink_distance={self.sink_distance}" if self.sinks and self.sink_distance else ""))
