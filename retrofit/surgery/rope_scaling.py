"""Zero-shot RoPE scaling of a loaded model through transformers' own ``rope_parameters``.

The context extensions a user tries first on a base model, before any conversion: YaRN
(``yarn``), dynamic NTK (``dynamic``) and position interpolation (``linear``), each with a
``factor``. transformers implements them from the config (``ROPE_INIT_FUNCTIONS``); this module
only rewrites the loaded model's config and rebuilds its rotary-embedding modules from it, so the
numbers are transformers' own. For a hybrid whose config has one entry per layer type (Gemma 3),
only the full-attention layers' RoPE changes, as the published Gemma 3 long-context recipe does.

    scale_rope(model, "yarn", 4.0)     # base pretrained at 8K, scored at up to 32K

``dynamic`` recomputes its frequencies from the longest position of each forward: a window's
scores then depend on its length (a shorter window is not a prefix of a longer one's scores).
Two consequences for scoring (:func:`dynamic_rope_modules`, :func:`reset_dynamic_rope`):

* a window run through the cache in chunks is not the window run at once: each chunk's keys are
  rotated with the frequencies of the positions seen so far, so later queries meet keys of
  another base; a scorer holds the frequencies at the whole window's length while it runs the
  chunks (:func:`dynamic_rope_held_at`), which gives one forward's numbers in a chunk's memory;
* transformers keeps the stretched frequencies of the longest sequence seen until a sequence
  *shorter* than the pretraining context arrives, so a window exactly as long as the context,
  scored after a longer one, would use the stretched base; a scorer resets them before each window.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
from torch import nn

from retrofit.errors import SpecError

__all__ = ["ROPE_SCALINGS", "dynamic_rope_held_at", "dynamic_rope_modules", "reset_dynamic_rope", "rope_scaling_of",
           "scale_rope"]

ROPE_SCALINGS = ("yarn", "dynamic", "linear")
_FULL = "full_attention"


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _scaled_parameters(params: dict, rope_type: str, factor: float, original: int) -> dict:
    new = dict(params)
    new.update(rope_type=rope_type, factor=float(factor))
    if rope_type == "yarn":
        new["original_max_position_embeddings"] = int(original)
    return new


def scale_rope(model: nn.Module, rope_type: str, factor: float) -> int:
    """Rebuild ``model``'s rotary embeddings with ``rope_type`` scaled by ``factor`` (in place).

    The pretraining context (``max_position_embeddings``) is the one scaled from; the config keeps
    it, as transformers' dynamic NTK expects. Returns how many rotary modules were rebuilt.
    Raises :class:`SpecError` for an unknown type, a factor that is not > 1, a model already
    scaled, or a model without rotary modules built from its config.
    """
    if rope_type not in ROPE_SCALINGS:
        raise SpecError(f"RoPE scaling must be one of {', '.join(ROPE_SCALINGS)}, got {rope_type!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1.0:
        raise SpecError(f"RoPE scaling factor must be a number > 1, got {factor!r}")
    config = _text_config(model)
    params = getattr(config, "rope_parameters", None)
    original = int(getattr(config, "max_position_embeddings", 0) or 0)
    if not isinstance(params, dict) or not original:
        raise SpecError(f"{getattr(config, 'model_type', 'this model')} has no rope_parameters / max_position_embeddings "
                        "to scale")
    per_type = _FULL in params and isinstance(params[_FULL], dict)
    current = params[_FULL] if per_type else params
    if current.get("rope_type", "default") != "default":
        raise SpecError(f"the model's RoPE is already {current.get('rope_type')!r}; scale an unscaled base")
    scaled = _scaled_parameters(current, rope_type, factor, original)
    new_params = {**params, _FULL: scaled} if per_type else scaled
    rotaries = [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")
                and getattr(m, "config", None) is not None]
    if not rotaries:
        raise SpecError(f"{type(model).__name__} has no rotary-embedding module built from its config")
    config.rope_parameters = new_params
    rebuilt = 0
    for name, module in rotaries:
        ref = next(iter(module.buffers()), None)
        cfg = copy.copy(module.config)
        cfg.rope_parameters = new_params
        fresh = type(module)(cfg) if ref is None else type(module)(cfg).to(ref.device)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)
        rebuilt += 1
    return rebuilt


def rope_scaling_of(model: nn.Module) -> dict | None:
    """``{"rope_type", "factor"}`` of the model's (full-attention) RoPE when it is scaled, else None."""
    params = getattr(_text_config(model), "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    params = params.get(_FULL, params) if isinstance(params.get(_FULL), dict) else params
    if params.get("rope_type", "default") == "default":
        return None
    return {"rope_type": params["rope_type"], "factor": params.get("factor")}


def dynamic_rope_modules(model: nn.Module) -> list[tuple[nn.Module, str | None]]:
    """``(rotary module, layer type or None)`` for each RoPE of ``model`` whose frequencies follow
    the sequence length (transformers' ``dynamic`` types); empty for every other model."""
    found = []
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        if not type(module).__name__.endswith("RotaryEmbedding") or kind is None:
            continue
        for layer_type, rope_type in (kind.items() if isinstance(kind, dict) else [(None, kind)]):
            if isinstance(rope_type, str) and "dynamic" in rope_type:
                found.append((module, layer_type))
    return found


@torch.no_grad()
def reset_dynamic_rope(model: nn.Module) -> int:
    """Put every length-following RoPE of ``model`` back at its pretraining frequencies.

    Runs each such module once on position 0, which takes transformers' own reset branch (a
    sequence shorter than the pretraining context); a module that never grew is left as it is.
    Returns how many modules were visited."""
    modules = dynamic_rope_modules(model)
    for module, layer_type in modules:
        _run_at(module, layer_type, 1)
    return len(modules)


@torch.no_grad()
def _run_at(module: nn.Module, layer_type: str | None, seq_len: int) -> None:
    """One call of a rotary module whose longest position is ``seq_len - 1`` (its update branches run)."""
    buffer = next(module.buffers())
    position = torch.full((1, 1), seq_len - 1, dtype=torch.long, device=buffer.device)
    module(buffer.new_zeros(1), position, **({} if layer_type is None else {"layer_type": layer_type}))


@contextlib.contextmanager
def dynamic_rope_held_at(model: nn.Module, seq_len: int) -> Iterator[int]:
    """Hold every length-following RoPE of ``model`` at the frequencies one forward of ``seq_len``
    tokens uses, for as long as the block runs, so a forward in chunks through the cache rotates
    every key and query as that one forward would.

    Within the block each such module first takes transformers' own reset and growth branches
    (as a fresh forward of ``seq_len`` tokens does), then is marked non-dynamic so that no chunk
    changes its frequencies. On exit its RoPE type is restored and its frequencies are reset to
    the pretraining ones. Yields how many modules are held (0: nothing to do)."""
    modules = dynamic_rope_modules(model)
    reset_dynamic_rope(model)
    kinds = {id(module): (module, module.rope_type) for module, _ in modules}
    try:
        for module, layer_type in modules:
            _run_at(module, layer_type, int(seq_len))
        for module, kind in kinds.values():  # transformers' update wrapper acts only on "dynamic" types
            module.rope_type = ({lt: "default" if isinstance(rt, str) and "dynamic" in rt else rt
                                 for lt, rt in kind.items()} if isinstance(kind, dict) else "default")
        yield len(modules)
    finally:
        for module, kind in kinds.values():
            module.rope_type = kind
        reset_dynamic_rope(model)
