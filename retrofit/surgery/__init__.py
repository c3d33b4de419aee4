"""Model surgery: conversion specs, ``convert``, checkpoints and loading.

    import retrofit
    model, tok = retrofit.surgery.load_any("gemma3-270m")
    retrofit.convert(model, retrofit.ConversionSpec(method="macchiato", window=128, latents=128))
    retrofit.surgery.save(model, "out/g270-mac", tokenizer=tok)
    model = retrofit.load("out/g270-mac")
    base, _ = retrofit.surgery.load_any("gemma3-270m")
    retrofit.surgery.cap_rope(base, 32767)   # its full-attention layers: no RoPE distance past 32767 (zero-shot)
"""
from retrofit.surgery.checkpoint import load, load_delta, save, save_delta
from retrofit.surgery.convert import convert
from retrofit.surgery.converted import (
    converted_layers, is_converted, new_module_names, new_parameter_names, retrofit_record,
)
from retrofit.surgery.loading import load_any
from retrofit.surgery.rope_cap import cap_rope, capped_layers
from retrofit.surgery.spec import ConversionSpec

__all__ = [
    "ConversionSpec",
    "DEFAULT_INIT_SWA_SHARE",
    "cap_rope",
    "capped_layers",
    "convert",
    "converted_layers",
    "is_converted",
    "load",
    "load_any",
    "load_delta",
    "new_module_names",
    "new_parameter_names",
    "retrofit_record",
    "save",
    "save_delta",
]


def __getattr__(name: str):
    # Macchiato's constant, read on demand: importing surgery (which the transformers registration
    # does, right after transformers' import, possibly while retrofit.layers is being imported)
    # must import no layer
    if name == "DEFAULT_INIT_SWA_SHARE":
        from retrofit.surgery import spec

        return spec.DEFAULT_INIT_SWA_SHARE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
