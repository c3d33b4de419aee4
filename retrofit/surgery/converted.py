"""Questions about a converted model that need no conversion code: is it converted, what did the
conversion record, which layers and weights are new, and marking exactly those trainable.

Below both :mod:`retrofit.surgery.convert` and :mod:`retrofit.surgery.auto_classes`.
"""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "converted_layers", "is_converted", "mark_new_trainable", "new_module_names", "new_parameter_names",
    "retrofit_record",
]


def is_converted(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "retrofit", None) is not None


def retrofit_record(model: nn.Module) -> dict[str, Any] | None:
    """The ``config.retrofit`` section of a converted model (None for a base model)."""
    return getattr(getattr(model, "config", None), "retrofit", None)


def converted_layers(model: nn.Module) -> list[int]:
    return sorted(int(m.layer_idx) for m in model.modules() if getattr(m, "is_retrofit_attention", False))


def new_parameter_names(model: nn.Module) -> list[str]:
    """Full names (as in ``model.named_parameters()``) of every weight the conversion added."""
    names = []
    for prefix, module in model.named_modules():
        if getattr(module, "is_retrofit_attention", False):
            names.extend(f"{prefix}.{n}" if prefix else n for n in module.new_parameter_names())
    return names


def new_module_names(model: nn.Module) -> list[str]:
    """Names of the modules holding the new weights, for ``peft.LoraConfig(modules_to_save=...)``.

    Short names (``latent_q``, ``latent_k``, ...; PEFT matches them as suffixes) when no pretrained
    module shares them, else full dotted paths. ``get_peft_model`` freezes everything it does not
    adapt, so a converted model keeps its new weights trainable with
    ``LoraConfig(..., modules_to_save=retrofit.surgery.new_module_names(model))``.
    """
    full = []
    for prefix, module in model.named_modules():
        if getattr(module, "is_retrofit_attention", False):
            full.extend(f"{prefix}.{m}" if prefix else m for m in module.new_module_names
                        if getattr(module, m, None) is not None)
    owners: dict[str, set[str]] = {}
    for name, _ in model.named_modules():
        owners.setdefault(name.rsplit(".", 1)[-1], set()).add(name)
    out = []
    for path in full:
        short = path.rsplit(".", 1)[-1]
        out.append(short if owners.get(short, set()) <= set(full) else path)
    return sorted(set(out))


def mark_new_trainable(model: nn.Module) -> nn.Module:
    """Freeze every pretrained weight and make exactly the new weights ``requires_grad=True``."""
    new = set(new_parameter_names(model))
    for name, p in model.named_parameters():
        p.requires_grad_(name in new)
    return model
