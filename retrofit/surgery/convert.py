"""``convert(model, spec)``: swap attention modules for a linear-time method, in place.

* finds the attention modules through the family patch (``retrofit.patches``; unsupported
  families raise ``UnsupportedModelError`` naming the supported ones),
* builds every replacement first, then swaps (a failure leaves the model untouched),
* the replacement holds the SAME pretrained submodule objects (no copies; state-dict keys
  unchanged) plus the method's new weights,
* freezes everything pretrained and marks only the new weights ``requires_grad=True``,
* switches the model to the ``"retrofit"`` attention implementation (2D padding masks only;
  see ``retrofit/patches/attention.py``) and caps the RoPE distance of the layers it leaves as
  full attention at ``spec.rope_cap`` (``retrofit/surgery/rope_cap.py``),
* records ``model.config.retrofit = {method, hyper-parameters, converted_layers,
  toolkit_version, base_model}`` (saved into config.json by ``save_pretrained``),
* gives the model its own identity (``retrofit/surgery/auto_classes.py``): config ``model_type``
  ``retrofit_<family>`` and class ``Retrofit<Base>ForCausalLM``, subclasses of the originals.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from retrofit.errors import SpecError
from retrofit.precision import cast_parameters
from retrofit.layers.method import get_method
from retrofit.surgery.converted import is_converted, mark_new_trainable, retrofit_record
from retrofit.surgery.records import spec_from_record
from retrofit.surgery.rope_cap import cap_rope
from retrofit.surgery.spec import ConversionSpec

__all__ = ["build_from_record", "convert"]


def _base_model_id(model: nn.Module) -> str | None:
    cfg = model.config
    name = getattr(cfg, "_name_or_path", None) or getattr(cfg, "name_or_path", None)
    return str(name) if name else None


def convert(model: nn.Module, spec: ConversionSpec | None = None, *, base_model: str | None = None, **overrides: Any) -> nn.Module:
    """Convert ``model`` in place and return it.

    ``spec`` defaults to ``ConversionSpec()``; keyword ``overrides`` replace its fields
    (``convert(model, method="exp-linear")``). ``base_model`` overrides the recorded base id
    (default: ``config._name_or_path``).
    """
    from retrofit._version import __version__
    from retrofit.patches import get_patch
    from retrofit.patches.attention import install_attention_function

    spec = spec or ConversionSpec()
    if overrides:  # common keys or the method's own (unknown / inapplicable keys: SpecError)
        spec = dataclasses.replace(spec, **overrides)
    spec.validate()
    if is_converted(model):
        raise SpecError(
            f"model is already converted ({retrofit_record(model).get('method')}); convert the base model instead"
        )
    patch = get_patch(model)
    spec.validate_for(model.config)
    spec = spec.resolved(model.config)
    method = get_method(spec.method)

    if spec.dtype is not None:  # parameters only: buffers such as RoPE inv_freq keep their fp32
        cast_parameters(model, spec.torch_dtype)
    sites = patch.attention_sites(model)
    if not sites:
        raise SpecError(f"found no {patch.family} attention modules in {type(model).__name__}")
    wanted = {s.layer_idx for s in sites} if spec.layers == "all" else set(spec.layer_indices(model.config))
    missing = wanted - {s.layer_idx for s in sites}
    if missing:
        raise SpecError(f"layers {sorted(missing)} have no attention module in this model")

    generator = torch.Generator().manual_seed(spec.seed)
    built = []
    for site in sites:
        if site.layer_idx in wanted:
            try:
                built.append((site, method.builder(site.module, patch, spec, site.layer_idx, generator)))
            except ValueError as exc:  # layer-level checks -> one clear spec error
                module = getattr(method.builder, "__module__", None) or ""
                by = "" if module.split(".")[0] == "retrofit" else f"method {spec.method!r} (plugin {module}): "
                raise SpecError(f"{by}layer {site.layer_idx}: {exc}") from None

    for site, new in built:
        setattr(site.parent, site.attr, new)
        new.teacher_rope_cap = int(spec.rope_cap)  # its original attention, as the kept full layers: capped
    mark_new_trainable(model)

    model.set_attn_implementation(install_attention_function())
    cap_rope(model, spec.rope_cap)  # the layers left as full attention: no RoPE distance past the base's context
    record = spec.to_dict()
    record.update(
        converted_layers=sorted(wanted),
        toolkit_version=__version__,
        base_model=base_model if base_model is not None else _base_model_id(model),
    )
    model.config.retrofit = record
    from retrofit.surgery.auto_classes import adopt

    return adopt(model)  # model_type "retrofit_<family>": never saved or loaded as its base


def build_from_record(model: nn.Module, record: dict[str, Any]) -> None:
    """Convert a freshly built base model to the architecture ``record`` (a checkpoint's
    ``config.retrofit``) describes; the record stays verbatim. What a ``Retrofit*ForCausalLM``
    runs in ``__init__`` (:mod:`retrofit.surgery.auto_classes`; the package wires it, so that module
    does not import this one)."""
    config = model.config
    del config.retrofit  # convert refuses an already converted model; it writes the record again
    try:
        convert(model, spec_from_record(record, "config.json"), base_model=record.get("base_model"))
    finally:
        config.retrofit = dict(record)
