"""Input paths in recipes and data registries: the bundled data, environment expansion, and paths
relative to the file that names them.

``bundled:NAME`` names data that ships inside the package (``retrofit/data/NAME``), e.g.
``bundled:pg-books/moby-dick.txt``: it resolves the same from a clone, an editable install and a
wheel, so the bundled recipes and the dataset registry need no path outside the package.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from retrofit.errors import SpecError

__all__ = ["BUNDLED_PREFIX", "bundled_data_dir", "expand_path"]

BUNDLED_PREFIX = "bundled:"
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def bundled_data_dir() -> Path:
    """The folder holding the data that ships with the package (``retrofit/data/``)."""
    return Path(__file__).resolve().parent


def _bundled(rest: str, value: str) -> Path:
    rel = Path(rest.lstrip("/"))
    if not rest.strip("/") or ".." in rel.parts:
        raise SpecError(f"path {value!r}: write {BUNDLED_PREFIX}NAME with NAME inside the bundled data "
                        f"(e.g. {BUNDLED_PREFIX}pg-books/moby-dick.txt)")
    return bundled_data_dir() / rel


def expand_path(value: str | os.PathLike, base_dir: str | os.PathLike) -> Path:
    """``bundled:NAME`` -> the package's data; else ``${VAR}`` / ``${VAR:-default}`` and ``~`` expanded
    and a relative result joined to ``base_dir``.

    >>> expand_path("${NO_SUCH_VAR:-../data}/books", "/repo/configs")
    PosixPath('/repo/configs/../data/books')
    >>> expand_path("bundled:pg-books", "/anywhere").name
    'pg-books'
    """

    def sub(m: re.Match) -> str:
        env = os.environ.get(m.group(1))
        if env:
            return env
        if m.group(2) is not None:
            return m.group(2)
        raise SpecError(f"path {str(value)!r} uses ${{{m.group(1)}}} but that environment variable is not set")

    text = _ENV.sub(sub, str(value))
    if text.startswith(BUNDLED_PREFIX):
        return _bundled(text[len(BUNDLED_PREFIX):], str(value))
    p = Path(os.path.expanduser(text))
    return p if p.is_absolute() else Path(base_dir) / p
