"""Documents (an id and its text) read from local files or streamed from a hub dataset, and the
text clean-up shared by training and evaluation (Project Gutenberg headers).

Used by ``retrofit.eval.corpora`` (named evaluation corpora) and ``retrofit.train.data`` (the
``data.strip_gutenberg`` recipe key); depends on nothing above ``retrofit.data``.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrofit.data.text import check_utf8, current_text_errors, read_text
from retrofit.errors import DataError

__all__ = ["Document", "file_documents", "hub_documents", "strip_gutenberg"]


@dataclass(frozen=True)
class Document:
    """One document: ``doc_id`` names it in results (file name, file:line or split:row)."""

    doc_id: str
    text: str


def file_documents(f: Path, rel: str, text_field: str = "text") -> Iterator[Document]:
    """The documents of one local file: a .txt file is one document (``rel``), a .jsonl/.json file
    one per non-blank line (``rel:LINE``, the text in ``text_field``).

    Bytes that are not UTF-8 follow the current ``--text-errors`` policy
    (:func:`retrofit.data.text.text_errors`): strict fails with the byte offset.
    """
    if f.suffix == ".txt":  # the same policy as training: strict (error + byte offset) unless asked
        yield Document(rel, read_text(f))
        return
    policy = current_text_errors()
    if policy == "strict":
        check_utf8(f)  # streams the file once; the error names the byte offset
    with f.open(encoding="utf-8", errors=policy) as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{f}:{i + 1}: not valid JSON ({exc.msg})") from None
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{f}:{i + 1}: no string field {text_field!r} (pass --text-field to choose one)"
                )
            yield Document(f"{rel}:{i + 1}", text)


def hub_documents(name: str, hub_id: str, *, config: str | None = None, split: str = "validation",
                  data_files: Any = None, text_field: str = "text") -> Iterator[Document]:
    """Stream a hub dataset's rows as documents ``split:ROW`` (never downloaded in full).

    ``name`` is the corpus's name in error messages.
    """
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - the eval extra ships datasets
        raise DataError("streaming hub datasets needs `datasets` (pip install 'retrofit[eval]')") from exc
    try:
        ds = datasets.load_dataset(hub_id, name=config, split=split, data_files=data_files, streaming=True)
        for i, row in enumerate(ds):
            text = row.get(text_field)
            if not isinstance(text, str):
                raise DataError(
                    f"dataset {name!r} ({hub_id}): rows have no string field {text_field!r}; "
                    f"fields are {sorted(row)}"
                )
            yield Document(f"{split}:{i}", text)
    except DataError:
        raise
    except Exception as exc:  # network, missing split, gated repo...
        raise DataError(
            f"could not stream dataset {name!r} ({hub_id}, split={split}): "
            f"{type(exc).__name__}: {exc}. Offline, evaluate on local files instead (e.g. pg-books)."
        ) from exc


_PG_START = re.compile(r"^\*\*\*\s*START OF.*$", re.MULTILINE | re.IGNORECASE)
_PG_END = re.compile(
    r"^(\*\*\*\s*END OF|End of (the )?Project Gutenberg)", re.MULTILINE | re.IGNORECASE
)


def strip_gutenberg(text: str) -> str:
    """Keep the text between Project Gutenberg's ``*** START OF`` and ``*** END OF`` lines
    (or the earlier ``End of Project Gutenberg's ...`` line); unchanged if there are none."""
    m = _PG_START.search(text)
    if m:
        text = text[m.end() :]
    m = _PG_END.search(text)
    if m:
        text = text[: m.start()]
    return text.strip()
