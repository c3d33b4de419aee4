"""The model a recipe trains: loaded (hub id, folder, alias, converted folder) and converted if needed."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from retrofit.errors import DataError, SpecError
from retrofit.train.recipe import Recipe

__all__ = ["build_model", "model_dtype"]


def model_dtype(recipe: Recipe, cuda: bool) -> torch.dtype:
    """``model.dtype``: ``auto`` loads bf16 on a GPU and fp32 on the CPU."""
    if recipe.model.dtype == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return getattr(torch, recipe.model.dtype)


def build_model(recipe: Recipe, *, dtype: torch.dtype, log=print) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)``: ``retrofit.surgery.load_any`` then ``convert`` with the recipe's
    ``conversion`` section unless the model is already converted. Parameters are not frozen
    here; :func:`retrofit.train.trainable.apply_trainable` decides what trains."""
    from retrofit import surgery

    model, tokenizer = surgery.load_any(recipe.model.name, dtype=dtype)
    if tokenizer is None:
        raise DataError(f"{recipe.model.name} has no tokenizer: training needs one to tokenise the data "
                        "(save it into the model folder with tokenizer.save_pretrained)")
    if surgery.is_converted(model):
        record = surgery.retrofit_record(model) or {}
        log(f"[retrofit] {recipe.model.name} is already converted ({record.get('method')}); "
            + ("the recipe's conversion section is not applied" if recipe.conversion else "training it as is"))
    else:
        if not recipe.conversion:
            raise SpecError(f"{recipe.model.name} is not a converted model and the recipe has no 'conversion' "
                            "section: add one (method, window, latents, init_swa_share, ...) or point model.name "
                            "at a folder written by 'retrofit convert'")
        try:
            spec = surgery.ConversionSpec.from_dict(recipe.conversion)
        except SpecError as exc:
            raise SpecError(f"recipe section 'conversion': {exc}") from None
        spec = spec.resolved(model.config)  # the window as converted (native under layers: global)
        surgery.convert(model, spec)
        log(f"[retrofit] converted {recipe.model.name}: {spec.describe()}")
    return model, tokenizer
