"""What an output path may be, and what ``--overwrite`` may replace.

``--overwrite`` replaces only a folder that is a model checkpoint written by this toolkit or by
transformers (``config.json`` with weights, or a retrofit delta, and nothing but the files
such folders hold), and never a folder that is or contains a protected path: the current
directory, the input model, a delta's base.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable

from retrofit.errors import CheckpointError

__all__ = ["check_output_folder", "check_replaceable", "is_replaceable_checkpoint", "protected_paths"]

# the files save_pretrained / tokenizer.save_pretrained / retrofit write into a model folder
_CHECKPOINT_FILE = re.compile(
    r"^(.*\.(json|safetensors|bin|model|jinja|txt|tiktoken)|README\.md|\.gitattributes|"
    r"\.[^/]+\.(json|safetensors)\.[0-9a-f]{8})$"
)
_WEIGHTS = re.compile(r"^(model|pytorch_model|delta)(-\d+-of-\d+)?\.(safetensors|bin)$|^.*\.safetensors\.index\.json$")


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(p))))


def check_output_folder(out: str | os.PathLike, what: str = "--out") -> Path:
    """``out`` must be a folder path: not an existing file, nor below one. Returns it."""
    path = Path(os.path.expanduser(os.fspath(out)))
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{what} {path} is an existing file; give a folder path")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"{what} {path} lies below the file {parent}; give a folder path")
            break
    return path


def is_replaceable_checkpoint(folder: str | os.PathLike) -> tuple[bool, str]:
    """``(ok, why_not)``: whether ``folder`` looks like a model checkpoint folder and holds nothing else."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return False, "it is not a folder"
    names = {p.name: p for p in folder.iterdir()}
    marker = ("config.json" in names and any(_WEIGHTS.match(n) for n in names)) or "retrofit_delta.json" in names
    if not marker:
        listed = ", ".join(sorted(names)[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        return False, f"no config.json with model weights nor a retrofit delta; it holds {listed or 'nothing'}"
    foreign = sorted(n for n, p in names.items() if p.is_dir() or p.is_symlink() or not _CHECKPOINT_FILE.match(n))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else "")
        return False, f"it also holds {shown}, which a checkpoint does not"
    return True, ""


def protected_paths(inputs: Iterable[str | os.PathLike | None] = ()) -> list[tuple[Path, str]]:
    """The current directory and every local input that exists, as real paths with a label."""
    out = [(_real(os.getcwd()), "the current directory")]
    for item in inputs:
        if item is None or str(item) == "":
            continue
        p = Path(os.path.expanduser(os.fspath(item)))
        if p.exists():
            out.append((_real(p), f"the input {item}"))
    return out


def check_replaceable(
    out: str | os.PathLike, *, overwrite: bool, protect: Iterable[str | os.PathLike | None] = ()
) -> None:
    """Refuse to write ``out`` where that would destroy something not ours.

    ``out`` must not be, nor contain, the current directory or a ``protect`` path (whether or not
    ``overwrite``); an existing ``out`` needs ``overwrite`` and must be a checkpoint folder.
    """
    out = check_output_folder(out)
    real = _real(out)
    for p, label in protected_paths(protect):
        if real == p or real in p.parents:
            rel = "is" if real == p else "contains"
            raise CheckpointError(f"the output {out} {rel} {label}; choose an output folder elsewhere")
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise CheckpointError(f"{out} already exists; choose another output folder or pass overwrite (--overwrite)")
    ok, why = is_replaceable_checkpoint(out)
    if not ok:
        raise CheckpointError(f"{out} exists and is not a checkpoint folder ({why}); --overwrite only replaces "
                              "model checkpoints: remove it yourself or choose another output folder")
