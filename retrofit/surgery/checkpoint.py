"""Checkpoints of converted models: full folders and deltas, safetensors only, written atomically.

Full checkpoint (``save`` / ``load``): an ordinary ``save_pretrained`` folder (config.json with a
``retrofit`` section, ``*.safetensors``, generation config, tokenizer). ``load`` rebuilds the
base architecture from config.json with plain transformers (no ``trust_remote_code``), converts
it with the recorded spec and loads the new weights, checking both directions: every weight
the spec creates must be in the files and every tensor in the files must belong to the model,
else ``CheckpointError``.

Delta (``save_delta`` / ``load_delta``): ``retrofit_delta.json`` (record + parameter names) and
``delta.safetensors`` holding only the new (and any other trainable) weights; it re-attaches to
its base model (a hub id, a local folder, a GGUF file or an alias such as ``gemma3-270m``,
resolved by ``load_any``).

Every writer builds the folder under a temporary name next to the target and renames it into
place at the end: a failure leaves nothing partial behind.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from retrofit.errors import CheckpointError
from retrofit.fs.atomic import atomic_directory  # re-exported: the old import path
from retrofit.surgery.convert import convert
from retrofit.surgery.converted import converted_layers, is_converted, new_parameter_names, retrofit_record
from retrofit.surgery.fingerprint import (
    SECTION_DIGEST_KEY, compare_fingerprints, section_digest, unreadable_format, weights_fingerprint,
)
from retrofit.surgery.records import check_section_digest, spec_from_record
from retrofit.surgery.sources import (
    ALIASES, first_line, load_plain, locate, quiet_transformers, read_config, read_json, resolve_dtype,
)

__all__ = [
    "DELTA_MANIFEST",
    "DELTA_WEIGHTS",
    "atomic_directory",
    "quiet_transformers",
    "is_delta",
    "load",
    "load_delta",
    "save",
    "save_delta",
]

DELTA_MANIFEST = "retrofit_delta.json"
TRAINING_FACTS = "retrofit_training.json"  # the card's training facts, machine-readable (reports name models by them)
DELTA_WEIGHTS = "delta.safetensors"
DELTA_FORMAT = "retrofit-delta/1"


# ---------------------------------------------------------------------- helpers
def _safetensors_keys(files: Iterable[Path]) -> dict[str, Path]:
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    where[k] = f
        except Exception as exc:  # SafetensorError, OSError: truncated, corrupt or unreadable
            raise CheckpointError(f"{f} is not a readable safetensors file ({first_line(exc)}); it is truncated or "
                                  "corrupt: write or download it again") from None
    return where


def _local_base(name: str | None) -> str | None:
    """An existing local base path made absolute (hub ids and aliases unchanged)."""
    if not name:
        return name
    if name in ALIASES:
        return name
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name


def _copy_tensors(model: nn.Module, names: Iterable[str], where: dict[str, Path], origin: str) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n], []).append(n)
    with torch.no_grad():
        for f, keys in by_file.items():
            with safe_open(str(f), framework="pt") as fh:
                for k in keys:
                    try:
                        t = fh.get_tensor(k)
                    except Exception as exc:
                        raise CheckpointError(f"{f}: cannot read {k} ({first_line(exc)}); the file is truncated "
                                              "or corrupt: write or download it again") from None
                    p = params[k]
                    if tuple(t.shape) != tuple(p.shape):
                        raise CheckpointError(
                            f"{origin}: {k} has shape {tuple(t.shape)} in the files but the retrofit section "
                            f"builds {tuple(p.shape)}; the weights do not match their config"
                        )
                    p.copy_(t.to(device=p.device, dtype=p.dtype))


def _sample(names: Iterable[str], n: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _refuse_mismatch(head: str, *found: tuple[str, Iterable[str]]) -> None:
    """``CheckpointError("head; what: a, b (+n more); ...")`` if any ``(what, names)`` has names."""
    parts = [f"{what}: {_sample(names)}" for what, names in found if names]
    if parts:
        raise CheckpointError("; ".join([head, *parts]))


def is_delta(path: str | os.PathLike) -> bool:
    return (Path(path) / DELTA_MANIFEST).is_file()


# ---------------------------------------------------------------------- full checkpoints
def save(
    model: nn.Module,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    *,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    card: dict | None = None,
) -> Path:
    """Write a converted model (and tokenizer) as a safetensors ``save_pretrained`` folder, atomically.

    The folder gets a ``README.md`` model card (``retrofit/surgery/card.py``); ``card`` adds
    ``training`` facts, held-out ``metrics`` and an ``adapter`` location to it; training facts are
    also written to ``retrofit_training.json`` (what reports read to name the model).
    """
    from retrofit.surgery.card import model_card
    from retrofit.surgery.auto_classes import adopt

    if not is_converted(model):
        raise CheckpointError("model is not converted (no config.retrofit); run retrofit.convert first")
    adopt(model)  # model_type retrofit_<family> even for a model converted before this version
    out = Path(out_dir)
    record = dict(retrofit_record(model))
    record[SECTION_DIGEST_KEY] = section_digest(record)
    model.config.retrofit = record
    new = set(new_parameter_names(model))
    counts = [0, 0]
    for name, p in model.named_parameters():
        counts[0] += p.numel() if name in new else 0
        counts[1] += p.numel()
    with atomic_directory(out, overwrite=overwrite, protect=[_local_base(record.get("base_model"))]) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shown = {**record, "base_model": _local_base(record.get("base_model"))}  # a local base as an absolute path,
        (tmp / "README.md").write_text(model_card(  # like the load snippet's folder; hub ids and aliases as given
            shown, model_type=model.config.model_type, new_parameters=counts[0],
            total_parameters=counts[1], path=str(out.expanduser().resolve()), **(card or {}),
        ))
        if card and card.get("training"):
            facts = {k: card[k] for k in ("training", "metrics") if card.get(k)}
            (tmp / TRAINING_FACTS).write_text(json.dumps(facts, indent=2, default=str) + "\n")
        pickles = [p.name for p in tmp.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        if pickles or not list(tmp.glob("*.safetensors")):
            raise CheckpointError(f"save_pretrained did not write safetensors only (found {pickles or 'no weights'})")
    return out


def load(
    path: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    *,
    device_map: Any = None,
) -> nn.Module:
    """Load a converted checkpoint folder (full or delta) and return the model in eval mode.

    ``dtype`` (e.g. ``torch.bfloat16``) defaults to the dtype the checkpoint was saved in.
    """
    path = Path(path)
    if is_delta(path):
        return load_delta(path, dtype=dtype)[0]
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} is not a checkpoint folder (no config.json)")
    raw = read_json(cfg_file)
    record = raw.get("retrofit")
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{path} has no 'retrofit' section in config.json: it is not a converted checkpoint "
            "(load base models with retrofit.surgery.load_any and convert them)"
        )
    spec = spec_from_record(record, str(path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found pickled weights {pickled}, which retrofit never loads)" if pickled else ""
        raise CheckpointError(f"{path} holds no *.safetensors weights{hint}")
    where = _safetensors_keys(files)

    from transformers import AutoModelForCausalLM

    from retrofit.surgery import auto_classes

    auto_classes.register_auto_classes()
    # a folder with its base's model_type: transformers builds the base, which is converted here (and warned
    # about: plain transformers loads it as the base). Pre-release folders are such, and so is what this version
    # saves for a model whose config is a subclass of its family's config class (adopt cannot give it the
    # retrofit class), so this path stays until save writes retrofit_<family> for those too.
    legacy = not str(raw.get("model_type", "")).startswith(auto_classes.PREFIX)
    with quiet_transformers():
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype if dtype is not None else "auto", output_loading_info=True, device_map=device_map,
                ignore_mismatched_sizes=True,  # reported below, with the retrofit section named
            )
        except (OSError, ValueError, RuntimeError, TypeError, KeyError) as exc:
            raise CheckpointError(f"cannot rebuild the converted architecture from {path}: {first_line(exc)}") from None
    if legacy:
        del model.config.retrofit  # from config.json; convert writes it again
        convert(model, spec, base_model=record.get("base_model"))
    new = new_parameter_names(model)
    missing = sorted(set(info.get("missing_keys") or []) - set(new))
    mismatched = info.get("mismatched_keys") or []
    if missing:
        raise CheckpointError(f"{path} lacks pretrained weights: {_sample(missing)}")
    if mismatched:
        raise CheckpointError(f"{path} has weights of the wrong shape: {_sample(str(m) for m in mismatched)}")
    model_keys = set(model.state_dict().keys())
    extra = set(where) - model_keys
    absent = set(new) - set(where)
    _refuse_mismatch(f"{path}: its retrofit section ({spec.describe()}) and its weights disagree",
                     ("weights the section needs but the files lack", absent),
                     ("tensors in the files the section does not explain", extra))
    recorded_layers = record.get("converted_layers")
    if recorded_layers is not None and list(recorded_layers) != converted_layers(model):
        raise CheckpointError(
            f"{path}: recorded converted_layers {recorded_layers} but the spec converts {converted_layers(model)}"
        )
    if legacy:
        _copy_tensors(model, new, where, str(path))
        _warn_legacy(path, str(raw.get("model_type")))
    # an edit the weights cannot reveal (window, init share, chunk size, ...) fails here
    check_section_digest(record, str(path))
    model.config.retrofit = dict(record)  # the checkpoint's record, verbatim
    return model.eval()


_WARNED: set[str] = set()


def _warn_legacy(path: Path, model_type: str) -> None:
    """Once per folder: it loads here, but plain transformers would load it as its base model."""
    import logging

    key = str(path.resolve())
    if key in _WARNED:
        return
    _WARNED.add(key)
    logging.getLogger("retrofit").warning(
        "%s was written by an older retrofit (config.json model_type %r, which plain transformers loads as the "
        "base model, silently dropping the new weights); loaded and converted here. Re-save it to give it its own "
        "model_type: retrofit.surgery.save(retrofit.load(%r), NEW_FOLDER)",
        path, model_type, str(path),
    )


# ---------------------------------------------------------------------- deltas
def save_delta(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    names: Iterable[str] | None = None,
    base_model: str | None = None,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write only the new weights (default: new + every ``requires_grad`` weight) and the record;
    ``extra_files`` (``{name: text}``, e.g. a fit report) are written into the same folder, atomically with it."""
    from safetensors.torch import save_file

    record = retrofit_record(model)
    if record is None:
        raise CheckpointError("model is not converted (no config.retrofit); nothing to save as a delta")
    record = dict(record)
    if base_model is not None:
        record["base_model"] = base_model
    if not record.get("base_model"):
        raise CheckpointError("the delta must name its base model: pass base_model= (a hub id, folder, GGUF or alias)")
    record["base_model"] = _local_base(str(record["base_model"]))  # bound by absolute path, not by cwd
    record[SECTION_DIGEST_KEY] = section_digest(record)
    params = dict(model.named_parameters())
    if names is None:
        chosen = list(dict.fromkeys([*new_parameter_names(model), *(n for n, p in params.items() if p.requires_grad)]))
    else:
        chosen = list(dict.fromkeys(names))
        unknown = [n for n in chosen if n not in params]
        if unknown:
            raise CheckpointError(f"not parameters of this model: {_sample(unknown)}")
    tensors = {n: params[n].detach().to("cpu").contiguous().clone() for n in chosen}
    held = set(chosen)
    base_fp = weights_fingerprint(model, [n for n in params if n not in held])
    manifest = {"format": DELTA_FORMAT, "retrofit": record, "parameters": chosen, "base_fingerprint": base_fp}
    out = Path(out_dir)
    with atomic_directory(out, overwrite=overwrite, protect=[record["base_model"]]) as tmp:
        save_file(tensors, str(tmp / DELTA_WEIGHTS), metadata={"format": "pt", "retrofit": DELTA_FORMAT})
        (tmp / DELTA_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name, text in (extra_files or {}).items():
            if Path(name).name != name or name in (DELTA_WEIGHTS, DELTA_MANIFEST):
                raise CheckpointError(f"extra file {name!r}: give a plain file name other than the delta's own")
            (tmp / name).write_text(text)
    return out


def load_delta(
    path: str | os.PathLike,
    base: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str | None = None,
) -> tuple[nn.Module, Any]:
    """Re-attach a delta to its base (``base`` or the recorded ``base_model``); returns ``(model, tokenizer)``."""
    path = Path(path)
    manifest = read_json(path / DELTA_MANIFEST)
    if manifest.get("format") != DELTA_FORMAT:
        raise CheckpointError(f"{path}: unknown delta format {manifest.get('format')!r} (expected {DELTA_FORMAT})")
    record = manifest.get("retrofit")
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: the delta manifest has no retrofit section")
    spec = spec_from_record(record, str(path))
    check_section_digest(record, str(path))
    recorded_fp = manifest.get("base_fingerprint")
    unreadable = unreadable_format(recorded_fp)
    if unreadable:
        raise CheckpointError(f"{path}: {unreadable}; make the delta again with this version (convert the base, "
                              "train, save it as a delta)")
    base = base if base is not None else record.get("base_model")
    if not base:
        raise CheckpointError(f"{path}: the delta names no base model; pass base=")
    base_path = Path(str(base)).expanduser()
    if base_path.exists() and (base_path.resolve() == path.resolve() or is_delta(base_path)):
        raise CheckpointError(f"{path}: its base {base} is {'the delta itself' if base_path.resolve() == path.resolve() else 'another delta'}; "
                              "a delta attaches to a base model: pass the original base (base=...)")
    weights = path / DELTA_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{path} lacks {DELTA_WEIGHTS}")
    where = _safetensors_keys([weights])
    listed = list(manifest.get("parameters") or [])
    if set(listed) != set(where):
        raise CheckpointError(f"{path}: manifest lists {_sample(listed)} but the file holds {_sample(where)}")

    folder, source, alias = locate(base)
    if folder is not None and (is_delta(folder) or "retrofit" in read_config(folder)):
        raise CheckpointError(f"the base {base} is itself converted; a delta attaches to a base model")
    model, tokenizer = load_plain(source, alias, resolve_dtype(dtype))
    if is_converted(model):
        raise CheckpointError(f"the base {base} is itself converted; a delta attaches to a base model")
    convert(model, spec, base_model=str(base))
    params = dict(model.named_parameters())
    new = set(new_parameter_names(model))
    absent = new - set(where)
    foreign = set(where) - set(params)
    _refuse_mismatch(f"{path}: the delta does not fit its base {base} converted with {spec.describe()}",
                     ("new weights missing from the delta", absent), ("delta tensors the model does not have", foreign))
    if recorded_fp:
        held = set(where)
        why = compare_fingerprints(recorded_fp, weights_fingerprint(model, [n for n in params if n not in held]))
        if why:
            raise CheckpointError(f"{path}: the base {base} is not the model this delta was made from ({why}); "
                                  "attach it to its original base (base=...)")
    _copy_tensors(model, list(where), where, str(path))
    model.config.retrofit = dict(record)
    return model.eval(), tokenizer
