"""Model families as data: the table in ``patches/families.py`` says, per ``model_type``, how to
reach q, k, v, o (separate or fused), RoPE, q/k norms, scaling, soft-capping and windows inside
that family's attention module (transformers 5.x), whether it needs BOS and its LoRA targets.

    from retrofit.patches import get_patch
    patch = get_patch(model)            # or a config; raises UnsupportedModelError
    for site in patch.attention_sites(model): ...

Another family is one :class:`Family` row: add it to ``FAMILIES`` in ``patches/families.py``, or
register it from your own module with ``register_family(Family(...))`` (an
:class:`AttentionPatch` instance works too), imported before use or named in the
``retrofit.families`` entry-point group (the rule every registry follows: :mod:`retrofit.plugins`).
"""
from __future__ import annotations

from typing import Any

from retrofit.errors import UnsupportedModelError
from retrofit.patches.base import AttentionPatch, AttentionSite, Family
from retrofit.plugins import Discovery, check_name

__all__ = [
    "AttentionPatch", "AttentionSite", "Family", "find_family", "get_patch", "register_family",
    "supported_model_types",
]

_REGISTRY: dict[str, AttentionPatch] = {}


def _register_table() -> None:
    from retrofit.patches.families import FAMILIES

    for row in FAMILIES:
        register_family(row)


_FOUND = Discovery("retrofit.families", _register_table)


def register_family(patch: AttentionPatch | Family, *, replace: bool = False) -> AttentionPatch:
    """Make ``patch`` (or the patch of a :class:`Family` row) the handler of each of its ``model_types``.

    A model_type another family already handles (a built-in's included) is a ``RetrofitError`` unless
    ``replace=True`` (the rule of every registry: :mod:`retrofit.plugins`); nothing is registered then."""
    _FOUND.builtins()
    if isinstance(patch, Family):
        patch = patch.patch()
    for model_type in patch.model_types:
        held = _REGISTRY.get(model_type)
        check_name("model_type", model_type, held, patch, replace=replace,
                   holder=f"family {held.family!r}" if held is not None else "")
    for model_type in patch.model_types:
        _REGISTRY[model_type] = patch
    return patch


def supported_model_types() -> dict[str, str]:
    """``{model_type: family}`` for every registered patch."""
    _FOUND.everything()
    return {mt: p.family for mt, p in sorted(_REGISTRY.items())}


def _model_type(config: Any) -> str | None:
    # a converted checkpoint's config (model_type "retrofit_<base>") names its base family
    return getattr(config, "retrofit_base_model_type", None) or getattr(config, "model_type", None)


def get_patch(model_or_config: Any) -> AttentionPatch:
    """The patch for a model (or its config), chosen by ``config.model_type``."""
    _FOUND.everything()
    config = getattr(model_or_config, "config", model_or_config)
    model_type = _model_type(config)
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    supported = ", ".join(f"{f} ({mt})" for mt, f in supported_model_types().items())
    hint = "".join(
        f" {model_type!r} (multimodal) checkpoints are not supported; load the text-only {p.family} causal LM"
        f" (model_type {p.model_types[0]!r}, e.g. {p.attention_class_name.removesuffix('Attention')}ForCausalLM)."
        for p in {id(p): p for p in _REGISTRY.values()}.values() if model_type in p.row.wrappers
    )
    raise UnsupportedModelError(
        f"model_type {model_type!r} has no retrofit patch. Supported families: {supported}.{hint}"
    )


def find_family(model_or_config: Any) -> Family | None:
    """The table row of a model (or config) for family facts (BOS, LoRA targets), or None.

    Lenient where :func:`get_patch` refuses: a multimodal wrapper (e.g. Gemma 3 ``gemma3``) is
    looked up by its text config's ``model_type``.
    """
    _FOUND.everything()
    config = getattr(model_or_config, "config", model_or_config)
    for cfg in (config, getattr(config, "text_config", None)):
        patch = _REGISTRY.get(_model_type(cfg)) if cfg is not None else None
        if patch is not None:
            return patch.row
    return None
