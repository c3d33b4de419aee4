"""Advisory locks on output folders: ``.NAME.lock`` beside the target, held with ``flock``.

Two writers of the same target cannot both proceed: the second gets :class:`LockError` naming
the holder. The lock is one primitive taken atomically: an exclusive ``flock`` on the lock file,
which the kernel releases when its holder exits however it dies, so a killed run's lock is free
at once and two processes racing for it cannot both win (a takeover never unlinks a file someone
else may hold). The file records the holder (pid, host, time) only to name it in the refusal.

The holder removes the file as it releases it, still holding the ``flock``; a contender that
locked the same file meanwhile finds the path gone (or naming another file) and starts over,
so holding the ``flock`` on the file the path names is what holding the lock means. A file that
names a holder on another host is refused (``flock`` may not reach across a network file
system); where the file system has no ``flock`` at all, a live pid on this host is the test.

The lock is re-entrant within a process (a CLI that locks its ``--out`` can call a saver that
locks it again). Taking the lock first settles a replacement of the target that a killed writer
left half done (:func:`retrofit.fs.tempdirs.recover_interrupted_swaps`).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from retrofit.errors import CheckpointError
from retrofit.fs.tempdirs import host_name, pid_alive, recover_interrupted_swaps

__all__ = ["LockError", "lock_path", "output_lock"]

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class LockError(CheckpointError):
    """Another live process writes the same output (or the lock cannot be taken at all)."""


@dataclass
class _Held:
    fd: int
    depth: int = 1
    made: tuple[Path, ...] = ()  # the folders taking the lock created, deepest first (removed again if left empty)


_HELD: dict[str, _Held] = {}  # lock file -> its open descriptor and re-entrance depth in this process


def lock_path(target: str | os.PathLike) -> Path:
    t = Path(os.path.abspath(os.fspath(target)))
    return t.parent / f".{t.name}.lock"


def _record(fd: int) -> dict | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _holder(info: dict | None) -> str:
    if info and info.get("pid") is not None:
        return f"pid {info.get('pid')} on {info.get('host')}"
    return "another process"


def _same_file(fd: int, lock: Path) -> bool:
    """Whether the path ``lock`` still names the file open as ``fd`` (its holder removes it on release)."""
    try:
        a, b = os.fstat(fd), os.stat(lock)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _flock(fd: int) -> bool | None:
    """Take the exclusive ``flock`` without waiting: True, False (a live process holds it), None (unsupported)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return None
        raise
    return True


def _refuse(target: Path, lock: Path, who: str) -> LockError:
    return LockError(f"{target} is being written by {who} (lock file {lock}); wait for that run to finish, "
                     f"or delete {lock} if that process is gone")


def _write_record(fd: int) -> None:
    data = json.dumps({"pid": os.getpid(), "host": host_name(), "time": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def _missing_folders(folder: Path) -> tuple[Path, ...]:
    """``folder`` and those above it that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return tuple(missing)


def _acquire(target: Path, lock: Path) -> tuple[int, tuple[Path, ...]]:
    """Open and lock ``lock``; returns its descriptor (the lock is held while it is open) and the folders
    made for it."""
    made = _missing_folders(lock.parent)
    unmade: OSError | None = None
    for _ in range(20):  # each retry follows a holder's release: a handful at most in practice
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileNotFoundError as exc:
            unmade = exc  # in a folder that is there, every time: no file can be made in it (/proc)
            continue  # a holder that made the folder released and removed it meanwhile: make it again
        except OSError as exc:
            raise LockError(f"cannot take the lock {lock} for {target}: {exc.strerror or exc}; choose a writable "
                            "output folder") from None
        try:
            got = _flock(fd)
            if got is False:
                raise _refuse(target, lock, _holder(_record(fd)))
            if not _same_file(fd, lock):
                os.close(fd)  # its holder released and removed it after we opened it: open the path again
                continue
            info = _record(fd)
            if info is not None and info.get("pid") != os.getpid():
                if info.get("host") != host_name():  # a flock may not reach across hosts: only its owner may free it
                    raise _refuse(target, lock, _holder(info))
                if got is None and pid_alive(_int(info.get("pid"))):
                    raise _refuse(target, lock, _holder(info))
            try:
                _write_record(fd)
            except OSError as exc:  # a full disk: leave no empty lock file behind to refuse the next run
                with contextlib.suppress(OSError):
                    if _same_file(fd, lock):
                        os.unlink(lock)
                raise LockError(f"cannot take the lock {lock} for {target}: {exc.strerror or exc}; free space "
                                "or choose a writable output folder") from None
            return fd, made
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            _remove_empty(made)
            raise
    if unmade is not None and lock.parent.is_dir():
        raise LockError(f"cannot take the lock {lock} for {target}: {unmade.strerror or unmade} (no file can be made "
                        f"in {lock.parent}); choose a writable output folder")
    raise LockError(f"cannot take the lock {lock} for {target}: other runs keep taking it; wait for them to finish")


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _release(lock: Path, fd: int) -> None:
    try:
        if _same_file(fd, lock):
            os.unlink(lock)  # still holding the flock: a contender that opened it sees the path gone and retries
    except OSError:
        pass
    finally:
        os.close(fd)  # releases the flock


def _remove_empty(folders: tuple[Path, ...]) -> None:
    """Remove ``folders`` (deepest first) where empty: a run that failed leaves no empty parents of its output."""
    for folder in folders:
        try:
            folder.rmdir()  # fails on a folder holding anything (the run's output, another run's lock)
        except OSError:
            return


@contextlib.contextmanager
def output_lock(target: str | os.PathLike) -> Iterator[Path]:
    """Hold the advisory lock of ``target`` (a folder that may not exist yet) for the ``with`` block."""
    lock = lock_path(target)
    key = str(lock)
    held = _HELD.get(key)
    if held is not None:
        held.depth += 1
    else:
        fd, made = _acquire(Path(target), lock)
        held = _HELD[key] = _Held(fd, made=made)
    try:
        if held.depth == 1:
            recover_interrupted_swaps(target)
        yield lock
    finally:
        held.depth -= 1
        if not held.depth:
            del _HELD[key]
            _release(lock, held.fd)
            _remove_empty(held.made)
