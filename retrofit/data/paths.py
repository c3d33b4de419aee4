"""Input paths in recipes: environment expansion, then relative to the recipe's folder."""
from __future__ import annotations

import os
import re
from pathlib import Path

from retrofit.errors import SpecError

__all__ = ["expand_path"]

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_path(value: str | os.PathLike, base_dir: str | os.PathLike) -> Path:
    """``${VAR}`` / ``${VAR:-default}`` and ``~`` expanded; a relative result is joined to ``base_dir``.

    >>> expand_path("${NO_SUCH_VAR:-../data}/books", "/repo/configs")
    PosixPath('/repo/configs/../data/books')
    """

    def sub(m: re.Match) -> str:
        env = os.environ.get(m.group(1))
        if env:
            return env
        if m.group(2) is not None:
            return m.group(2)
        raise SpecError(f"path {str(value)!r} uses ${{{m.group(1)}}} but that environment variable is not set")

    p = Path(os.path.expanduser(_ENV.sub(sub, str(value))))
    return p if p.is_absolute() else Path(base_dir) / p
