"""Model-family patches: one module per family that knows how to reach q, k, v, o, RoPE, q/k norms,
scaling and soft-capping inside that family's attention module (transformers 5.x).

    from retrofit.patches import get_patch
    patch = get_patch(model)            # or a config; raises UnsupportedModelError
    for site in patch.attention_sites(model): ...

Another family is added by writing ``patches/<family>.py`` with an :class:`AttentionPatch`
subclass and calling :func:`register_patch` (or listing it in ``_BUILTIN``).
"""
from __future__ import annotations

import importlib
from typing import Any

from retrofit.errors import UnsupportedModelError
from retrofit.patches.base import AttentionPatch, AttentionSite

__all__ = ["AttentionPatch", "AttentionSite", "get_patch", "register_patch", "supported_model_types"]

_BUILTIN = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3")
_REGISTRY: dict[str, AttentionPatch] = {}
_LOADED = False


def _load_builtin() -> None:
    global _LOADED
    if _LOADED:
        return
    for name in _BUILTIN:
        register_patch(importlib.import_module(f"retrofit.patches.{name}").PATCH)
    _LOADED = True


def register_patch(patch: AttentionPatch) -> None:
    """Make ``patch`` the handler of each of its ``model_types``."""
    for model_type in patch.model_types:
        _REGISTRY[model_type] = patch


def supported_model_types() -> dict[str, str]:
    """``{model_type: family}`` for every registered patch."""
    _load_builtin()
    return {mt: p.family for mt, p in sorted(_REGISTRY.items())}


def get_patch(model_or_config: Any) -> AttentionPatch:
    """The patch for a model (or its config), chosen by ``config.model_type``."""
    _load_builtin()
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    # a converted checkpoint's config (model_type "retrofit_<base>") names its base family
    model_type = getattr(config, "retrofit_base_model_type", None) or model_type
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    supported = ", ".join(f"{f} ({mt})" for mt, f in supported_model_types().items())
    hint = ""
    if model_type == "gemma3":
        hint = " Gemma 3 multimodal checkpoints are not supported; load the text-only Gemma3ForCausalLM."
    raise UnsupportedModelError(
        f"model_type {model_type!r} has no retrofit patch. Supported families: {supported}.{hint}"
    )
