"""Atomic file writes: readers see the old file or the new one, never a half-written one.

Every writer builds the content in a temporary file in the target's own folder (same file
system, so the rename is atomic), flushes and fsyncs it, renames it over the target with
``os.replace`` and fsyncs the folder. On any error (including KeyboardInterrupt / SIGTERM turned
into an exception) the temporary file is removed and the old target is left untouched.

This module is the toolkit's one writer of files: whole files (:func:`atomic_file` and the
``write_*_atomic`` helpers, :func:`save_figure_atomic`), whole folders (:func:`atomic_directory`),
their removal (:func:`remove_directory`) and append-only logs (:class:`AppendLog`).
``tests/test_one_writer.py`` fails on code elsewhere that opens a file for writing in place.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

from retrofit.errors import CheckpointError
from retrofit.fs.guard import MANIFEST, check_replaceable, file_record, folder_files
from retrofit.fs.locks import output_lock
from retrofit.fs.tempdirs import SWAP_KIND, clean_stale_temps, make_temp_dir, settle_swap, temp_name
from retrofit.fs.write_errors import write_failure

__all__ = [
    "AppendLog", "atomic_directory", "atomic_file", "fsync_dir", "json_text", "remove_directory", "save_figure_atomic",
    "symlink_atomic", "write_bytes_atomic", "write_json_atomic", "write_manifest", "write_text_atomic",
]


def _process_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_process_umask()  # what open() would give a new file (mkstemp gives 0600)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename inside it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", *, suffix: str = ".tmp") -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing; on success it replaces ``path``.

    ``mode`` is ``"w"`` (UTF-8 text) or ``"wb"``. The parent folder is created if missing. The
    temporary file is ``.NAME.XXXX.tmp`` (``suffix`` lets a writer that infers the format from the
    name, e.g. matplotlib, see the right ending).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh
            fh.flush()
            os.fchmod(fh.fileno(), _FILE_MODE)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_file(path, "w") as fh:
        fh.write(text)
    return Path(path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_file(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def symlink_atomic(link: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Make ``link`` a symbolic link to ``target`` (kept as given: relative stays relative), replacing
    an existing link in one rename; a real file or folder at ``link`` is an error, never replaced."""
    link = Path(link)
    if link.exists() and not link.is_symlink():
        raise FileExistsError(f"{link} exists and is not a symbolic link")
    tmp = link.with_name(f".{link.name}.{os.getpid()}.link-tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)
    fsync_dir(link.parent)
    return link


def _finite(o: Any) -> Any:
    """JSON has no inf/nan: write them as strings so every reader can parse the file."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    """Tensors / numpy scalars as numbers, everything else (paths, dtypes, ...) as its string."""
    if hasattr(o, "item"):
        try:
            return o.item()
        except (TypeError, ValueError):
            pass
    return str(o)


def json_text(obj: Any, *, indent: int = 2, sort_keys: bool = False, finite: bool = False,
              default: Callable[[Any], Any] | None = _json_default) -> str:
    """``obj`` as JSON text ending in a newline; ``finite`` writes inf/nan as strings."""
    return json.dumps(_finite(obj) if finite else obj, indent=indent, sort_keys=sort_keys, default=default) + "\n"


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int = 2, sort_keys: bool = False,
                      finite: bool = False, default: Callable[[Any], Any] | None = _json_default) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (see :func:`json_text` for the options)."""
    text = json_text(obj, indent=indent, sort_keys=sort_keys, finite=finite, default=default)
    return write_text_atomic(path, text)


def save_figure_atomic(fig: Any, path: str | os.PathLike, *, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically (format from ``path``'s ending, e.g. PNG)."""
    path = Path(path)
    with atomic_file(path, "wb", suffix=path.suffix or ".png") as fh:
        fig.savefig(fh, dpi=dpi, bbox_inches="tight", format=(path.suffix.lstrip(".") or "png"))
    return path


class AppendLog:
    """A file of one record per line that only ever holds whole records (``metrics.jsonl``).

    :meth:`append` adds a record with one ``write`` on a descriptor opened ``O_APPEND``; a write
    that fails part-way is cut back, so no torn record stays behind. A line without its newline
    at the end of the file (the writer killed mid-write, or a crash of the machine) is no record:
    :meth:`records` skips it and :meth:`retain` drops it. :meth:`retain` rewrites the file
    atomically (a resumed run drops the records past its checkpoint, so none is written twice);
    :meth:`sync` makes every appended record durable (call it before publishing a checkpoint,
    so no record the checkpoint has seen can be lost). One writer at a time (hold the output
    folder's lock, :func:`retrofit.fs.output_lock`); readers may read while it writes.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _read(self) -> tuple[list[str], bool]:
        """``(complete lines, whether a torn line follows them)``."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], False
        *whole, torn = data.split(b"\n")  # the last piece is b"" after a final newline, else a torn record
        return [line.decode("utf-8") for line in whole], bool(torn)

    def records(self) -> list[str]:
        """The complete lines (without their newline), oldest first; ``[]`` if there is no file."""
        return self._read()[0]

    def retain(self, keep: Callable[[str], bool]) -> int:
        """Atomically keep only the complete records ``keep`` accepts; returns how many lines went."""
        lines, torn = self._read()
        kept = [line for line in lines if keep(line)]
        dropped = len(lines) - len(kept) + int(torn)
        if dropped:
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        return dropped

    def append(self, record: str) -> None:
        """Add ``record`` (one line, no newline inside) at the end, whole or not at all."""
        if "\n" in record or "\r" in record:
            raise ValueError("an AppendLog record is one line: it holds no newline")
        data = (record + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.fstat(fd).st_size
            try:
                done = 0
                while done < len(data):
                    done += os.write(fd, data[done:])
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)  # a full disk or an interrupt leaves no half record
                raise
        finally:
            os.close(fd)

    def sync(self) -> None:
        """Flush the records appended so far (and the file's entry in its folder) to disk."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.path.parent)


def write_manifest(folder: str | os.PathLike) -> Path:
    """Record every file now in ``folder`` as written by retrofit, with its size, modification time and sha256
    (what makes it replaceable later, as long as each file is as written: see :mod:`retrofit.fs.guard`)."""
    files = [f for f in folder_files(folder)[0] if f != MANIFEST]
    records = {f: file_record(Path(folder) / f) for f in files}
    return write_text_atomic(Path(folder) / MANIFEST, json.dumps(
        {"written_by": "retrofit", "files": files, "records": records}, indent=1) + "\n")


def remove_directory(path: str | os.PathLike) -> None:
    """Delete the folder ``path``: renamed out of the way first (``.NAME.trash-PID-HOST-RAND``), then
    removed, so an interrupted delete leaves no half folder under its name; a killed one's trash is
    removed by the next :func:`retrofit.fs.clean_stale_temps` of the folder it was in."""
    path = Path(path)
    if not path.exists():
        return
    trash = temp_name(path.parent, path.name, kind="trash")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _swap(new: Path, target: Path) -> None:
    """Replace ``target`` by ``new`` through a swap folder; interrupted, the swap is settled, never lost."""
    swap = make_temp_dir(target.parent, target.name, kind=SWAP_KIND)
    try:
        os.rename(new, swap / "new")
        os.rename(target, swap / "old")
        os.rename(swap / "new", target)
    except BaseException:
        with contextlib.suppress(OSError):
            settle_swap(target, swap, undo=True)  # this write failed: the previous version stays
        raise
    shutil.rmtree(swap, ignore_errors=True)
    fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_directory(
    out_dir: str | os.PathLike, *, overwrite: bool = False, protect: Iterable[str | os.PathLike | None] = (),
) -> Iterator[Path]:
    """Yield a fresh temporary folder next to ``out_dir``; rename it to ``out_dir`` on success.

    The finished folder gets a manifest of its files (:func:`write_manifest`).
    The target is locked for the whole write (``.NAME.lock``, see :mod:`retrofit.fs.locks`). An
    existing target is replaced only with ``overwrite`` and only if it is a checkpoint folder that
    neither is nor contains the current directory or a ``protect`` path (see
    :func:`retrofit.fs.check_replaceable`). The temporary folder is named after this process
    (``.NAME.tmp-PID-HOST-RAND``): a failure or SIGTERM removes it, and after a SIGKILL the next
    writer of the same target removes it. Replacing goes through a swap folder (see
    :mod:`retrofit.fs.tempdirs`): an exception between its renames is settled at once, a SIGKILL
    by the next writer, so the target is never lost.
    """
    out = Path(out_dir)
    check_replaceable(out, overwrite=overwrite, protect=protect)
    with output_lock(out):
        clean_stale_temps(out.parent, out.name)
        try:
            tmp = make_temp_dir(out.parent, out.name)
        except OSError as exc:
            raise CheckpointError(f"cannot write into {out.parent}: {exc.strerror or exc}; choose a writable "
                                  "output folder") from None
        try:
            yield tmp
            write_manifest(tmp)  # what proves, later, that --overwrite may replace it
            os.chmod(tmp, 0o755)
            if out.exists() or out.is_symlink():
                check_replaceable(out, overwrite=overwrite, protect=protect)  # appeared or changed meanwhile
                _swap(tmp, out)
            else:
                os.rename(tmp, out)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"cannot write {out}: {exc.strerror or exc}; free space or choose a writable "
                                  "output folder (nothing was written)") from None
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            failed = write_failure(exc)  # a full disk as torch's zip writer or safetensors reports it
            if failed:
                raise CheckpointError(f"cannot write {out}: {failed}; free space or choose a writable output folder "
                                      "(nothing was written)") from None
            raise
