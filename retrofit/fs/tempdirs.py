"""Temporary folders a later run can recognise: ``.NAME.KIND-PID-HOST-RAND`` next to the target.

A folder whose writer (``PID`` on this ``HOST``) is no longer alive is stale and is removed by
:func:`clean_stale_temps`; :func:`terminate_on_sigterm` turns SIGTERM into an exception so the
``except``/``finally`` blocks that remove a temporary folder run on ``kill`` as on Ctrl-C.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import threading
from pathlib import Path

__all__ = ["Terminated", "clean_stale_temps", "host_name", "make_temp_dir", "pid_alive", "terminate_on_sigterm"]

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


def make_temp_dir(parent: Path, name: str, kind: str = "tmp") -> Path:
    """Create and return ``parent/.NAME.KIND-PID-HOST-RAND`` (``kind``: lower-case letters)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f".{name}.{kind}-{os.getpid()}-{host_name()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def clean_stale_temps(parent: Path, name: str | None = None) -> list[Path]:
    """Remove ``parent``'s temporary folders (and files) of dead writers on this host; return them.

    ``name`` restricts the clean-up to one target's temporaries.
    """
    parent = Path(parent)
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    host = host_name()
    for p in entries:
        m = _TEMP.match(p.name)
        if not m or (name is not None and m.group("name") != name):
            continue
        if m.group("host") != host or pid_alive(int(m.group("pid"))):
            continue
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
