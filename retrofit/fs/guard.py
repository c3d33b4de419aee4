"""What an output path may be, and what ``--overwrite`` may replace.

``--overwrite`` replaces only a folder this toolkit wrote (:func:`retrofit.fs.atomic_directory`
leaves a manifest, ``.retrofit-files.json``, listing every file it wrote with its size, modification
time and sha256: see :func:`retrofit.fs.atomic.write_manifest`) that holds nothing beyond those files,
each as written (a user's note dropped in, or a file the user edited, makes it irreplaceable: what
retrofit did not write is never deleted), and never a folder that is or contains a protected path:
the current directory, the input model, a delta's base; nor one inside the input model's or the base's folder.

A listed file counts as unchanged when its size and modification time (ns) are as recorded; when the
time differs (a copy, a ``touch``) its content is hashed and compared, so an edit is caught whatever its
size, and a multi-GB checkpoint is not read again on every check (any write through the file system
moves the time; only a deliberately restored time with same-size content would pass unhashed).
A manifest of an earlier version (names only) is checked by names.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from retrofit.errors import CheckpointError

__all__ = [
    "MANIFEST", "check_not_model_folder", "check_output_folder", "check_replaceable", "file_record", "folder_files",
    "is_replaceable_checkpoint", "protected_paths", "special_kind",
]

MANIFEST = ".retrofit-files.json"


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(p))))


def special_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it exists but is neither a regular file nor a folder (``/dev/null`` is a character
    device), or when it is a symbolic link to nothing; None for a file, a folder, or a path that is not there.

    An input check that only asks ``is_file()`` / ``is_dir()`` would call such a path missing: the
    caller says what it is instead, and what to give.
    """
    import stat

    p = Path(os.path.expanduser(os.fspath(path)))
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return "a symbolic link to a path that does not exist" if os.path.islink(p) else None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    for test, what in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"{what}, not a regular file"
    return "not a regular file"


def check_output_folder(out: str | os.PathLike, what: str = "--out") -> Path:
    """``out`` must be a folder path: not an existing file, nor below one. Returns it."""
    path = Path(os.path.expanduser(os.fspath(out)))
    if path.exists() and not path.is_dir():
        kind = special_kind(path)
        raise CheckpointError(f"{what} {path} is {kind.split(',')[0] if kind else 'an existing file'}; give a "
                              "folder path")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"{what} {path} lies below the file {parent}; give a folder path")
            break
    return path


# what marks a folder as a model or checkpoint (transformers, PEFT, GGUF, a training checkpoint, retrofit's manifest)
MODEL_MARKERS = ("config.json", "adapter_config.json", "*.safetensors", "pytorch_model*.bin", "*.gguf",
                 "trainer_state.json", MANIFEST)


def check_not_model_folder(out: str | os.PathLike, what: str = "--out",
                           inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
    """Results (bench, eval) never go into a model or checkpoint folder: ``out`` must hold none of
    :data:`MODEL_MARKERS` and be neither an input folder nor inside one. Returns ``out`` checked as a folder path."""
    path = check_output_folder(out, what)
    real = _real(path)
    for item in inputs:
        if item is None or str(item) == "":
            continue
        p = Path(os.path.expanduser(os.fspath(item)))
        if p.is_dir() and (real == _real(p) or _real(p) in real.parents):
            where = "is" if real == _real(p) else "lies inside"
            raise CheckpointError(f"{what} {path} {where} the model folder {item}; results never go into a model "
                                  "folder: choose an output folder elsewhere")
    if path.is_dir():
        found = sorted({f.name for pattern in MODEL_MARKERS for f in path.glob(pattern)})
        if found:
            raise CheckpointError(f"{what} {path} holds a model or checkpoint ({', '.join(found[:3])}); results never "
                                  "go into a model folder: choose an output folder elsewhere")
    return path


def folder_files(folder: str | os.PathLike) -> tuple[list[str], list[str]]:
    """``(files, odd)`` under ``folder`` as relative POSIX paths: plain files, and links / other entries
    (a sub-folder that cannot be read is one: what it holds is unknown, so it is never retrofit's)."""
    files, odd = [], []

    def unreadable(exc: OSError) -> None:
        where = os.path.relpath(exc.filename, folder) if exc.filename is not None else "."
        odd.append(Path(where).as_posix() + "/ (unreadable)")

    for root, dirs, names in os.walk(folder, onerror=unreadable):
        rel = Path(root).relative_to(folder)
        for name in sorted(dirs):
            if os.path.islink(os.path.join(root, name)):
                odd.append((rel / name).as_posix())
        for name in names:
            full = os.path.join(root, name)
            (files if os.path.isfile(full) and not os.path.islink(full) else odd).append((rel / name).as_posix())
    return sorted(files), sorted(odd)


def _sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: str | os.PathLike) -> dict:
    """What a manifest records of a file: ``{"size", "mtime_ns", "sha256"}``."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(path)}


def _manifest(folder: Path) -> tuple[set[str], dict] | None:
    """``(names, records by name)`` from ``folder``'s manifest (records empty for an earlier version's); None if
    there is no readable manifest retrofit wrote."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
        files = data["files"] if isinstance(data, dict) and data.get("written_by") == "retrofit" else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, list):
        return None
    records = data.get("records")
    return set(map(str, files)), records if isinstance(records, dict) else {}


def _changed(folder: Path, name: str, record: dict | None) -> bool:
    """Whether the listed file ``name`` differs from its manifest record (a file gone is no change: nothing to lose)."""
    if record is None:
        return False  # an earlier version's manifest: names only
    try:
        st = os.stat(folder / name)
    except OSError:
        return False
    if not isinstance(record, dict) or st.st_size != record.get("size"):
        return True
    if st.st_mtime_ns == record.get("mtime_ns"):
        return False
    try:
        return _sha256(folder / name) != record.get("sha256")
    except OSError:
        return True


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "") if names else "nothing"


def is_replaceable_checkpoint(folder: str | os.PathLike) -> tuple[bool, str]:
    """``(ok, why_not)``: whether retrofit wrote ``folder`` (its manifest) and it holds no other file."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return False, "it is not a folder"
    files, odd = folder_files(folder)
    manifest = _manifest(folder)
    if manifest is None:
        return False, f"retrofit did not write it (no readable {MANIFEST}); it holds {_listed(files + odd)}"
    known, records = manifest
    foreign = sorted(odd + [f for f in files if f != MANIFEST and f not in known])
    if foreign:
        return False, f"it also holds {_listed(foreign)}, which retrofit did not write there"
    edited = [f for f in files if f != MANIFEST and _changed(folder, f, records.get(f) if records else None)]
    if edited:
        return False, f"{_listed(edited)} changed since retrofit wrote it (edited by hand?)"
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

    ``out`` must not be, nor contain, the current directory or a ``protect`` path, nor lie inside a
    ``protect`` folder (whether or not ``overwrite``); an existing ``out`` needs ``overwrite`` and must be a
    checkpoint folder.
    """
    out = check_output_folder(out)
    real = _real(out)
    protect = list(protect)
    for p, label in protected_paths(protect):
        if real == p or real in p.parents:
            rel = "is" if real == p else "contains"
            raise CheckpointError(f"the output {out} {rel} {label}; choose an output folder elsewhere")
    for p, label in protected_paths(protect)[1:]:  # the inputs (the current directory may hold an output)
        if p in real.parents and p.is_dir():
            # the input folder would hold a second model (and whatever replaced or deleted the input, the output)
            raise CheckpointError(f"the output {out} lies inside {label}; write it outside the input folder "
                                  "(e.g. next to it)")
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise CheckpointError(f"{out} already exists; choose another output folder or pass overwrite (--overwrite)")
    ok, why = is_replaceable_checkpoint(out)
    if not ok:
        raise CheckpointError(f"{out} exists and is not a checkpoint folder ({why}); --overwrite only replaces "
                              "checkpoints retrofit wrote, as it wrote them: remove it yourself or choose another "
                              "output folder")
