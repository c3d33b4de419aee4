"""One policy for undecodable text, in training and in evaluation.

``strict`` (the default): a file that is not valid UTF-8 is an error naming the file and the
byte offset of the first bad byte. ``replace``: bad bytes decode to U+FFFD, on request only
(``data.text_errors=replace`` in a recipe, ``--text-errors replace`` for ``retrofit eval``).
"""
from __future__ import annotations

import codecs
import contextlib
import contextvars
import os
from pathlib import Path
from typing import Iterator

from retrofit.errors import DataError

__all__ = ["TEXT_ERRORS", "check_utf8", "read_text", "text_errors", "current_text_errors"]

TEXT_ERRORS = ("strict", "replace")
_POLICY: contextvars.ContextVar[str] = contextvars.ContextVar("retrofit_text_errors", default="strict")
_CHUNK = 1 << 20


def _check_policy(errors: str) -> str:
    if errors not in TEXT_ERRORS:
        raise DataError(f"text error policy must be one of {', '.join(TEXT_ERRORS)}, got {errors!r}")
    return errors


def current_text_errors() -> str:
    return _POLICY.get()


@contextlib.contextmanager
def text_errors(errors: str) -> Iterator[None]:
    """Set the policy :func:`read_text` / :func:`check_utf8` use by default within the block."""
    token = _POLICY.set(_check_policy(errors))
    try:
        yield
    finally:
        _POLICY.reset(token)


def _bad_utf8(path: Path, offset: int, bad: bytes, option: str) -> DataError:
    return DataError(f"{path}: not valid UTF-8 at byte {offset} (0x{bad[:4].hex()}); convert the file to UTF-8 "
                     f"(e.g. iconv -f latin1 -t utf-8), or decode bad bytes as U+FFFD with {option}")


def check_utf8(path: str | os.PathLike, *, option: str = "--text-errors replace") -> None:
    """Raise :class:`DataError` naming the file and byte offset if ``path`` is not valid UTF-8.

    Reads the file in 1 MiB chunks through an incremental decoder (constant memory). ``option``
    is how the caller's user asks for the ``replace`` policy instead.
    """
    path = Path(path)
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    done = 0
    try:
        with path.open("rb") as fh:
            while True:
                chunk = fh.read(_CHUNK)
                final = not chunk
                try:
                    decoder.decode(chunk, final=final)
                except UnicodeDecodeError as exc:
                    # exc.object: the decoder's held-back bytes from earlier chunks + this chunk
                    offset = done - (len(exc.object) - len(chunk)) + exc.start
                    raise _bad_utf8(path, offset, exc.object[exc.start:exc.end], option) from None
                if final:
                    return
                done += len(chunk)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_text(path: str | os.PathLike, errors: str | None = None, *, option: str = "--text-errors replace") -> str:
    """The file's text under the policy (``errors`` or the current one): strict errors name the byte offset."""
    path = Path(path)
    errors = _check_policy(errors or current_text_errors())
    data = path.read_bytes()
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise _bad_utf8(path, exc.start, data[exc.start:exc.end], option) from None
