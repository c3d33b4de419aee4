"""A bounded tier of exact tokens beside a layer's window and its linear read (:mod:`retrofit.ops.exact_tier`).

A Hedgehog layer with ``tier > 0`` keeps, per KV head, up to ``tier`` tokens that left its window
as exact keys read by the pretrained softmax, chosen by ``tier_rule`` every ``tier_block`` tokens;
the rest go into its linear read as before. The three tiers share one normalisation, the decoding
cache stays constant in the context (window + tier + state), and a prefill keeps exactly the tokens
a token-by-token decode keeps. The tier needs no training: the read's maps and scale are the
layer's own (fitted or trained without the tier).

This module holds the layer's side: the cache entry (:class:`TierLayerCache`), the call
(:func:`tiered_attend`) and :func:`set_tier`, which switches a converted model's tier on, off or
to other settings in memory (what ``retrofit eval --zero-shot tier:N`` does).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from retrofit.layers.cache import RetrofitLayerCache
from retrofit.ops import tiered_attention
from retrofit.ops.exact_tier import RETRIEVE_SCORES, TIER_RULES, TierState
from retrofit.ops.rope import rope_unrotate
from retrofit.ops.sinks import first_valid

__all__ = ["DEFAULT_TIER_BLOCK", "RETRIEVE_SCORES", "TIER_RULES", "TierLayerCache", "set_tier", "tier_layers", "tiered_attend"]

# Tokens settled at a time: the window holds w to w + 63 tokens; the selection runs once per 64 tokens.
DEFAULT_TIER_BLOCK = 64


class TierLayerCache(RetrofitLayerCache):
    """The decoding-cache entry of a layer with an exact tier: the three tiers (:class:`TierState`:
    the unsettled window, the tier, the read's state) and the attention sinks
    ``(idx (B, n), valid (B, n), k, v (B, Hkv, n, .))``. Bounded: ``w + C - 1`` window tokens,
    ``tier`` tokens per KV head, the read's ``(F, D)`` state per query head, ``n`` sinks."""

    def __init__(self, **kwargs: Any):
        super().__init__(window=0, **kwargs)
        self.tier: TierState | None = None
        self.sinks: tuple[torch.Tensor, ...] | None = None

    def store_tier(self, tier: TierState, sinks: tuple[torch.Tensor, ...] | None, num_new: int) -> None:
        self.tier = tier
        self.sinks = None if sinks is None else tuple(t.detach() for t in sinks)
        self.cumulative_length += int(num_new)
        if not self.is_initialized:
            self.dtype, self.device = tier.keys.dtype, tier.keys.device
            self.is_initialized = True

    def extra_tensors(self) -> list[torch.Tensor | None]:
        return [*(self.tier.tensors() if self.tier is not None else []), *(self.sinks or ())]

    def reset(self) -> None:
        self.tier = self.sinks = None
        super().reset()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.tier = None if self.tier is None else self.tier.apply(fn)
        self.sinks = None if self.sinks is None else tuple(fn(t) for t in self.sinks)
        super()._apply(fn)


def tier_layers(model: nn.Module) -> list[nn.Module]:
    """The converted layers of ``model`` that can hold an exact tier (Hedgehog layers)."""
    return [m for m in model.modules() if hasattr(m, "tier") and hasattr(m, "feature_key")]


def set_tier(model: nn.Module, capacity: int, rule: str = "recall", block: int = DEFAULT_TIER_BLOCK,
             retrieve: int = 0, retrieve_score: str = "max", layers: Sequence[int] | None = None) -> int:
    """Give every Hedgehog layer of ``model`` an exact tier of ``capacity`` tokens per KV head (0: none),
    chosen by ``rule`` every ``block`` tokens, or (``retrieve`` > 0, ``capacity`` 0) block retrieval of
    ``retrieve`` stored blocks per query, ranked by ``retrieve_score``; ``layers``: only the Hedgehog layers with
    these decoder-layer indices (None: all), the others get neither. Returns the number of layers given the tier
    or retrieval. A cache filled before the change must not be reused."""
    if rule not in TIER_RULES:
        raise ValueError(f"tier rule must be one of {', '.join(TIER_RULES)}, got {rule!r}")
    if capacity < 0 or block < 1 or retrieve < 0:
        raise ValueError(f"tier capacity and retrieve must be >= 0 and its block >= 1, got {capacity}, {retrieve} "
                         f"and {block}")
    if retrieve_score not in RETRIEVE_SCORES:
        raise ValueError(f"retrieve_score must be one of {', '.join(RETRIEVE_SCORES)}, got {retrieve_score!r}")
    if capacity and retrieve:
        raise ValueError(f"block retrieval replaces the tier: give a capacity of 0 with retrieve={retrieve}")
    found = {layer.layer_idx: layer for layer in tier_layers(model)}
    chosen = set(found) if layers is None else {int(i) for i in layers}
    if chosen - set(found):
        raise ValueError(f"layers must be indices of the model's Hedgehog layers ({_ranges(sorted(found))}), got "
                         f"{sorted(chosen - set(found))}")
    for i, layer in found.items():
        on = i in chosen
        layer.tier, layer.tier_rule, layer.tier_block = int(capacity) if on else 0, rule, int(block)
        layer.retrieve, layer.retrieve_score = int(retrieve) if on else 0, retrieve_score
    return len(chosen)


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _sinks(layer: nn.Module, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, cache: TierLayerCache | None,
           start: int) -> tuple[torch.Tensor, ...] | None:
    """The first ``layer.sinks`` real tokens among those cached and this call's (stream index ``start`` on)."""
    if not layer.sinks:
        return None
    if cache is not None and cache.sinks is not None and bool(cache.sinks[1].all()):
        return cache.sinks  # every row has its n sinks: later tokens never become sinks
    B, T = valid.shape
    cand = [torch.arange(start, start + T, device=k.device).expand(B, T), valid, k, v]
    if cache is not None and cache.sinks is not None:
        cand = [torch.cat([a, b], dim=1 if a.dim() == 2 else 2) for a, b in zip(cache.sinks, cand)]
    return first_valid(layer.sinks, *cand)


def tiered_attend(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                  cache: TierLayerCache | None, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A Hedgehog layer's attention with its exact tier: ``(B, Hq, T, D)`` for this call's ``q (B, Hq, T, d)``,
    ``k``, ``v`` ``(B, Hkv, T, .)`` (``valid (B, T)`` or None), through ``cache`` when decoding.

    The read's queries and keys are the layer's own: position-free with ``memory_distance`` (keys
    rotated back to position 0 with the rotation they were given, queries moved to the distance;
    a tier key is then scored as the read scores it), else the pretrained post-RoPE ones."""
    B, H, T, _ = q.shape
    if valid is None:
        valid = torch.ones(B, T, dtype=torch.bool, device=q.device)
    if layer.memory_distance is not None:
        cos, sin = position_embeddings
        mq, mk = layer.memory_query(q, cos, sin), rope_unrotate(k, cos, sin)
    else:
        mq, mk = q, k
    fq = layer.feature_query(mq)
    scale = layer.memory_scale(mq, torch.zeros(B, 1, T, device=q.device))  # a . q + b; the count term is the op's
    start = cache.cumulative_length if cache is not None else 0
    sinks = _sinks(layer, k, v, valid, cache, start)
    out, state = tiered_attention(
        q, k, v, mq, mk, fq, scale, feature_key_weight=layer.feature_key.weight, count_weight=layer.memory_scale.count_weight,
        window=layer.window, block=layer.tier_block, capacity=layer.tier, rule=layer.tier_rule,
        retrieve=layer.retrieve, retrieve_score=layer.retrieve_score, scaling=layer.scaling,
        softcap=layer.softcap, key_padding_mask=valid, sinks=sinks, sink_distance=layer.sink_distance,
        inv_freq=layer.sink_inv_freq, state=cache.tier if cache is not None else None,
    )
    if cache is not None:
        cache.store_tier(state, sinks, T)
    return out
