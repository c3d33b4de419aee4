"""What a resumed run checks its local data against: each file's path, size and sha256, and the list itself.

A checkpoint records, for the training files and the held-out files, every file the recipe's
``data.files`` (and ``eval.files``) resolved to, with its size and the sha256 of its whole content.
A resume recomputes them and refuses any difference: a file rewritten, added or removed makes the
resumed run read other text than the run that wrote the checkpoint, so its trajectory (and its
data position, which counts documents and tokens of the old files) no longer holds.

The whole content is hashed, streamed in 1 MiB chunks, once when the run starts: a sample of the file
(its head and tail) or its modification time would miss an edit in the middle, or a copy that keeps
the time (``cp -p``, ``rsync -t``); training reads these files anyway, and sha256 streams at about a
GB/s, so the cost is a second or so per GB at start. Paths are recorded relative to the recipe's
folder when they lie inside it, so a project moved as a whole resumes.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

__all__ = ["compare_data_digests", "data_digest", "file_digest"]

_CHUNK = 1 << 20


def file_digest(path: str | os.PathLike) -> dict:
    """``{"size": bytes, "sha256": hex}`` of the file's whole content, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _name(path: Path, base_dir: str | os.PathLike) -> str:
    base = Path(os.path.abspath(base_dir))
    full = Path(os.path.abspath(path))
    return str(full.relative_to(base)) if full == base or base in full.parents else str(full)


def _entries(files: Iterable[Path] | None, base_dir: str | os.PathLike) -> list[dict]:
    return [{"path": _name(f, base_dir), **file_digest(f)} for f in (files or [])]


def data_digest(files, base_dir: str | os.PathLike = ".") -> dict:
    """The digest of a run's :class:`~retrofit.train.data.DataFiles` (a hub dataset contributes no files)."""
    return {"train": _entries(files.train, base_dir), "held_out": _entries(files.held_out, base_dir)}


def _bytes(n) -> str:
    return f"{n:,} bytes" if isinstance(n, int) else "an unknown size"


def compare_data_digests(recorded: dict, now: dict) -> str | None:
    """What differs between two :func:`data_digest` results, in a few words (the first difference); None if nothing."""
    for part, label in (("train", "training file"), ("held_out", "held-out file")):
        before = {str(e.get("path")): e for e in recorded.get(part, []) if isinstance(e, dict)}
        after = {e["path"]: e for e in now.get(part, [])}
        for path, entry in after.items():
            old = before.get(path)
            if old is None:
                return f"the {label} {path} was added"
            if old.get("size") != entry["size"]:
                return f"the {label} {path} changed ({_bytes(old.get('size'))} then, {_bytes(entry['size'])} now)"
            if old.get("sha256") != entry["sha256"]:
                return f"the {label} {path} changed (same size, other content: sha256 {str(old.get('sha256'))[:12]} " \
                       f"then, {entry['sha256'][:12]} now)"
        gone = [p for p in before if p not in after]
        if gone:
            return f"the {label} {gone[0]} is gone"
        if list(before) != list(after):
            return f"the {label}s are read in another order"
    return None
