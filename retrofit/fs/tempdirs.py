"""Temporary folders a later run can recognise: ``.NAME.KIND-PID-HOST-RAND`` next to the target.

A folder whose writer (``PID`` on this ``HOST``) is no longer alive is stale and is removed by
:func:`clean_stale_temps`; :func:`terminate_on_sigterm` turns SIGTERM into an exception so the
``except``/``finally`` blocks that remove a temporary folder run on ``kill`` as on Ctrl-C.

Replacing a folder goes through a swap folder ``.NAME.old-PID-HOST-RAND`` (see
:func:`retrofit.fs.atomic_directory`): the finished new folder moves in as ``new``, the target
moves in as ``old``, then ``new`` becomes the target. A writer killed between those renames
leaves no target; :func:`settle_swap` (run by the next writer of the target, under its lock)
completes the swap from ``new`` or, failing that, puts ``old`` back. The clean-up never
deletes a swap folder while the target is missing: its ``old`` may be the only copy.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from pathlib import Path

__all__ = [
    "Terminated", "clean_stale_temps", "host_name", "make_temp_dir", "pid_alive", "recover_interrupted_swaps",
    "settle_swap", "temp_name", "terminate_on_sigterm",
]

logger = logging.getLogger("retrofit.fs")
SWAP_KIND = "old"  # the kind of a swap folder (it always holds the replaced target while one is missing)

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>[a-z]+)-(?P<pid>\d+)-(?P<host>[A-Za-z0-9_.-]+)-(?P<rand>[0-9a-f]{8})$")


class Terminated(BaseException):
    """Raised in the main thread when the process receives SIGTERM (see :func:`terminate_on_sigterm`)."""


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def temp_name(parent: Path, name: str, kind: str = "tmp") -> Path:
    """``parent/.NAME.KIND-PID-HOST-RAND`` (``kind``: lower-case letters), a name this process owns."""
    return Path(parent) / f".{name}.{kind}-{os.getpid()}-{host_name()}-{secrets.token_hex(4)}"


def make_temp_dir(parent: Path, name: str, kind: str = "tmp") -> Path:
    """Create and return ``parent/.NAME.KIND-PID-HOST-RAND`` (``kind``: lower-case letters)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    path = temp_name(parent, name, kind)
    path.mkdir()
    return path


def _dead_temps(parent: Path, name: str | None = None) -> list[tuple[Path, re.Match]]:
    """``parent``'s temporaries (of target ``name``, or all) whose writer on this host is dead."""
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return []
    host = host_name()
    found = []
    for p in entries:
        m = _TEMP.match(p.name)
        if not m or (name is not None and m.group("name") != name):
            continue
        if m.group("host") == host and not pid_alive(int(m.group("pid"))):
            found.append((p, m))
    return found


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _swap_in_doubt(target: Path, swap: Path) -> bool:
    """Whether deleting ``swap`` could lose data: its target is missing, or it holds both versions."""
    return not _exists(target) or ((swap / "new").is_dir() and (swap / "old").is_dir())


def settle_swap(target: Path, swap: Path, *, undo: bool = False) -> str | None:
    """Finish or undo the interrupted replacement of ``target`` whose swap folder is ``swap``.

    Target missing: ``swap/new`` (complete) becomes it, else ``swap/old`` goes back (``undo``:
    ``old`` first). The swap folder is then removed, unless the target exists beside both ``new``
    and ``old`` (someone made a new target meanwhile: nothing is deleted). Returns what was done.
    """
    target, swap = Path(target), Path(swap)
    new, old = swap / "new", swap / "old"
    done = None
    if not _exists(target):
        order = ((old, "undid", "previous"), (new, "completed", "new")) if undo else \
            ((new, "completed", "new"), (old, "undid", "previous"))
        src = next(((p, verb, which) for p, verb, which in order if p.is_dir()), None)
        if src is None:
            shutil.rmtree(swap, ignore_errors=True)  # killed before anything moved in
            return None
        os.rename(src[0], target)
        done = f"{src[1]} the interrupted replacement of {target} (the {src[2]} version is in place)"
    if _swap_in_doubt(target, swap):
        logger.warning("retrofit.fs: %s exists beside the interrupted swap %s (its old/ and new/ are kept): "
                       "look inside and delete what you do not need", target, swap)
        return done
    shutil.rmtree(swap, ignore_errors=True)
    return done


def recover_interrupted_swaps(target: str | os.PathLike) -> list[str]:
    """Settle every swap of ``target`` left by a dead writer (call under the target's lock); logs each."""
    target = Path(os.path.abspath(os.fspath(target)))
    done = []
    for swap, m in _dead_temps(target.parent, target.name):
        if m.group("kind") == SWAP_KIND and swap.is_dir() and not swap.is_symlink():
            what = settle_swap(target, swap)
            if what:
                logger.warning("retrofit.fs: %s", what)
                done.append(what)
    return done


def clean_stale_temps(parent: Path, name: str | None = None) -> list[Path]:
    """Remove ``parent``'s temporary folders (and files) of dead writers on this host; return them.

    ``name`` restricts the clean-up to one target's temporaries. A swap folder is left for
    :func:`recover_interrupted_swaps` while its target is missing.
    """
    parent = Path(parent)
    removed: list[Path] = []
    for p, m in _dead_temps(parent, name):
        if m.group("kind") == SWAP_KIND and p.is_dir() and _swap_in_doubt(parent / m.group("name"), p):
            continue  # its old/ may be the only copy of the target
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except OSError:
                continue
        removed.append(p)
    return removed


def _raise_terminated(signum, frame):  # noqa: ARG001
    raise Terminated(f"terminated by signal {signum}")


def terminate_on_sigterm() -> bool:
    """Make SIGTERM raise :class:`Terminated` in the main thread (if its handler is the default)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return False
    signal.signal(signal.SIGTERM, _raise_terminated)
    return True
