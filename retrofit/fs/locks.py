"""Advisory locks on output folders: ``.NAME.lock`` beside the target holds pid, host and time.

Two writers of the same target cannot both proceed: the second gets :class:`LockError` naming
the holder. A lock whose pid is dead on this host (a killed run) is stale and taken over. The
lock is re-entrant within a process (a CLI that locks its ``--out`` can call a saver that locks
it again). Taking the lock first settles a replacement of the target that a killed writer left
half done (:func:`retrofit.fs.tempdirs.recover_interrupted_swaps`).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Iterator

from retrofit.errors import CheckpointError
from retrofit.fs.tempdirs import host_name, pid_alive, recover_interrupted_swaps

__all__ = ["LockError", "lock_path", "output_lock"]

_HELD: dict[str, int] = {}  # lock file -> re-entrance depth in this process
_UNREADABLE_GRACE_S = 10.0  # a lock file being written is briefly empty


class LockError(CheckpointError):
    """Another live process writes the same output."""


def lock_path(target: str | os.PathLike) -> Path:
    t = Path(os.path.abspath(os.fspath(target)))
    return t.parent / f".{t.name}.lock"


def _read(lock: Path) -> dict | None:
    try:
        data = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stale(lock: Path, info: dict | None) -> bool:
    if info is None:
        try:
            return time.time() - lock.stat().st_mtime > _UNREADABLE_GRACE_S
        except OSError:
            return True
    if info.get("host") != host_name():
        return False  # cannot tell on another machine: only its owner (or a person) may remove it
    try:
        return not pid_alive(int(info.get("pid", -1)))
    except (TypeError, ValueError):
        return True


def _acquire(target: Path, lock: Path) -> None:
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            info = _read(lock)
            if _stale(lock, info):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                continue
            who = f"pid {info.get('pid')} on {info.get('host')}" if info else "another process"
            raise LockError(f"{target} is being written by {who} (lock file {lock}); wait for that run to finish, "
                            f"or delete {lock} if that process is gone") from None
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": os.getpid(), "host": host_name(), "time": time.time()}, fh)
        return
    raise LockError(f"cannot take the lock {lock} for {target}; delete it if no run is writing {target}")


@contextlib.contextmanager
def output_lock(target: str | os.PathLike) -> Iterator[Path]:
    """Hold the advisory lock of ``target`` (a folder that may not exist yet) for the ``with`` block."""
    lock = lock_path(target)
    key = str(lock)
    if _HELD.get(key):
        _HELD[key] += 1
    else:
        _acquire(Path(target), lock)
        _HELD[key] = 1
    try:
        if _HELD[key] == 1:
            recover_interrupted_swaps(target)
        yield lock
    finally:
        _HELD[key] -= 1
        if not _HELD[key]:
            del _HELD[key]
            info = _read(lock)
            if info is not None and info.get("pid") == os.getpid() and info.get("host") == host_name():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
