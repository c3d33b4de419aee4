"""Failed writes that do not arrive as ``OSError``.

A full (or failing) disk reaches Python as an ``OSError`` from ``open``/``write``, but two writers
every checkpoint goes through report it otherwise:

* torch's zip writer (``torch.save``, DeepSpeed's optimizer states) raises ``RuntimeError``
  (``[enforce fail at inline_container.cc:...] . unexpected pos ...``, ``PytorchStreamWriter
  failed writing file ...``);
* safetensors (every ``save_pretrained``) raises its own ``SafetensorError`` (``Error while
  serializing: IoError(Os { code: 28, kind: StorageFull, ... })``, or ``I/O error: No space left on
  device (os error 28)`` since 0.6).

:func:`write_failure` recognises both, so a caller can give one clear line instead of a traceback.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

__all__ = ["free_space", "write_failure"]

_TORCH_MARKERS = ("inline_container", "PytorchStreamWriter", "iostream error", "file write failed")
_OS_MESSAGE = re.compile(r'message: "([^"]+)"|I/O error:\s*([^\n]+)')


def write_failure(exc: BaseException) -> str | None:
    """What failed, in a few words, when ``exc`` is a failed write of torch's zip writer or of
    safetensors; None for any other exception (including a plain ``OSError``: it says it itself)."""
    text = str(exc)
    if type(exc).__name__ == "SafetensorError" and ("IoError" in text or "I/O error" in text):
        found = _OS_MESSAGE.search(text)
        what = next((g for g in found.groups() if g), "") if found else ""
        return f"writing a safetensors file failed ({what.strip() or text.strip()})"
    if isinstance(exc, RuntimeError) and any(marker in text for marker in _TORCH_MARKERS):
        return "a write failed (torch's file writer stopped short)"
    return None


def free_space(folder: str | Path) -> str:
    """``"N MiB free on its disk"`` for ``folder`` (or its nearest existing parent), or ``"free space unknown"``."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB free on its disk"
    except OSError:
        return "free space unknown"
