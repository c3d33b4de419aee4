"""Cap the RoPE distance of a model's full-attention layers (ReRoPE-style), zero-shot.

A layer that stays softmax attention over the whole context (a converted model's kept layers,
or any layer of a base model) sees, past its pretraining context, RoPE distances it never saw.
Capped at ``distance``, a pair farther apart is scored at ``distance`` (nothing changes within
it): Gemma 3 270M, pretrained at 32K, scores 29.8 perplexity on a 64K window of a held-out book
uncapped and 22.9 with its three global layers capped at 32767 (BENCHMARKS.md, "Past the
pretraining context, beside zero-shot baselines"). The math is :func:`retrofit.ops.capped_rope_attention`; the layer carries a
:class:`retrofit.patches.attention.RopeCap` that the ``"retrofit"`` attention reads, so the
model runs under that implementation afterwards.

:func:`retrofit.convert` caps the layers it leaves as full attention (the spec's ``rope_cap``,
default the base's ``max_position_embeddings - 1``); ``retrofit eval --rope-cap N`` caps a base
model's for comparison.
"""
from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from retrofit.errors import SpecError

__all__ = ["cap_rope", "capped_layers", "default_rope_cap"]


def default_rope_cap(config: Any) -> int:
    """The farthest RoPE distance the base was pretrained on (``max_position_embeddings - 1``), or 0
    (no cap) when the config does not say."""
    return max(0, int(getattr(config, "max_position_embeddings", 0) or 0) - 1)


def cap_rope(model: nn.Module, distance: int | None) -> list[int]:
    """Cap (``distance >= 1``) or un-cap (``0`` / None) every full-attention layer of ``model`` that is
    still the family's own softmax attention (native sliding-window layers and converted layers are
    left alone). Returns the capped layer indices; a layer whose RoPE frequencies depend on the
    sequence (``dynamic``) is skipped with a warning. Capping switches the model to the
    ``"retrofit"`` attention implementation."""
    from retrofit.patches import get_patch
    from retrofit.patches.attention import ROPE_CAP_ATTR, RopeCap, install_attention_function

    if distance is not None and (isinstance(distance, bool) or not isinstance(distance, int) or distance < 0):
        raise SpecError(f"rope_cap must be a non-negative integer number of tokens (0 = no cap), got {distance!r}")
    patch = get_patch(model)
    capped, skipped = [], []
    for site in patch.attention_sites(model):
        module = site.module
        if getattr(module, "is_retrofit_attention", False) or patch.native_window(module) is not None:
            continue
        if not distance:
            if hasattr(module, ROPE_CAP_ATTR):
                delattr(module, ROPE_CAP_ATTR)
            continue
        inv_freq = patch.rope_inv_freq(module)
        if inv_freq is None:
            skipped.append(site.layer_idx)
            continue
        setattr(module, ROPE_CAP_ATTR, RopeCap(int(distance), inv_freq))
        capped.append(site.layer_idx)
    if skipped:
        warnings.warn(f"layers {skipped}: this model's RoPE type has no fixed frequencies; their distance is not "
                      "capped", stacklevel=2)
    if capped and getattr(model.config, "_attn_implementation", None) != "retrofit":
        model.set_attn_implementation(install_attention_function())
    return capped


def capped_layers(model: nn.Module) -> dict[int, int]:
    """``{layer index: cap}`` of the model's capped full-attention layers."""
    from retrofit.patches.attention import ROPE_CAP_ATTR

    out = {}
    for name, module in model.named_modules():
        cap = getattr(module, ROPE_CAP_ATTR, None)
        if cap is not None:
            out[int(module.layer_idx)] = int(cap.distance)
    return dict(sorted(out.items()))
