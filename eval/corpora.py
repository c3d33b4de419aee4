"""Evaluation corpora: a registry of named datasets (configs/datasets.yaml) and local files.

A corpus is an iterator of :class:`Document` (an id and its text). Hub datasets are streamed
with `datasets` (never downloaded in full); local corpora are .txt files (one document each),
.jsonl/.json files (one document per line, ``text_field`` holds the text) or folders of them.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retrofit.data.text import check_utf8, current_text_errors, read_text
from retrofit.errors import DataError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json")
PROTOCOLS = ("windows", "packed")


@dataclass(frozen=True)
class Document:
    """One document: ``doc_id`` names it in results (file name, file:line or split:row)."""

    doc_id: str
    text: str


@dataclass(frozen=True)
class CorpusSpec:
    """Where a corpus's documents come from (one registry entry, or a local path)."""

    name: str
    description: str = ""
    hub_id: str | None = None
    config: str | None = None
    split: str = "validation"
    data_files: Any = None
    path: str | None = None
    path_env: str | None = None
    files: tuple[str, ...] = ()
    text_field: str = "text"
    protocol: str = "windows"
    strip_gutenberg: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return self.hub_id is None

    def describe(self) -> dict:
        """JSON-friendly provenance for results files."""
        out: dict[str, Any] = {"name": self.name, "protocol": self.protocol}
        if self.is_local:
            out["path"] = str(resolve_local_path(self))
            if self.files:
                out["files"] = list(self.files)
        else:
            out.update(hub_id=self.hub_id, config=self.config, split=self.split)
        out["text_field"] = self.text_field
        return out


def repo_root() -> Path:
    """The folder holding retrofit/ and configs/ (relative registry paths resolve here)."""
    return Path(__file__).resolve().parents[1]


def registry_path() -> Path:
    return repo_root() / "configs" / "datasets.yaml"


def load_registry(path: str | Path | None = None) -> dict[str, CorpusSpec]:
    """Read the dataset registry YAML into ``{name: CorpusSpec}``."""
    import yaml

    p = Path(path) if path is not None else registry_path()
    if not p.is_file():
        try:  # installed (non-editable) layout: the YAML ships as package data
            from importlib import resources

            p = Path(str(resources.files("retrofit.configs") / "datasets.yaml"))
        except Exception:  # pragma: no cover - defensive
            pass
    if not p.is_file():
        raise DataError(f"dataset registry not found at {p}")
    raw = yaml.safe_load(p.read_text()) or {}
    known = {f for f in CorpusSpec.__dataclass_fields__ if f not in ("name", "extra")}
    out: dict[str, CorpusSpec] = {}
    for name, entry in raw.items():
        entry = dict(entry or {})
        kwargs = {k: entry.pop(k) for k in list(entry) if k in known}
        if "files" in kwargs:
            files = kwargs["files"]
            kwargs["files"] = tuple([files] if isinstance(files, str) else files)
        spec = CorpusSpec(name=name, extra=entry, **kwargs)
        if spec.protocol not in PROTOCOLS:
            raise DataError(f"{p}: dataset {name!r} has protocol {spec.protocol!r}; use one of {PROTOCOLS}")
        if (spec.hub_id is None) == (spec.path is None):
            raise DataError(f"{p}: dataset {name!r} needs exactly one of 'hub_id' or 'path'")
        out[name] = spec
    return out


def resolve_corpus(
    name_or_path: str,
    *,
    registry: dict[str, CorpusSpec] | None = None,
    text_field: str | None = None,
    protocol: str | None = None,
) -> CorpusSpec:
    """A registry name (``pg-books``, ``slimpajama``, ...) or a local file/folder -> CorpusSpec.

    ``text_field`` / ``protocol`` override the registry's values when given.
    """
    reg = load_registry() if registry is None else registry
    if name_or_path in reg:
        spec = reg[name_or_path]
    else:
        p = Path(name_or_path).expanduser()
        if not p.exists():
            raise DataError(
                f"unknown dataset {name_or_path!r}: not in the registry ({', '.join(sorted(reg))}) "
                f"and no such file or folder. Pass a registry name or a path to .txt/.jsonl files."
            )
        if p.is_file() and p.suffix not in LOCAL_SUFFIXES:
            raise DataError(f"{p}: unsupported file type {p.suffix!r}; use {', '.join(LOCAL_SUFFIXES)}")
        # Project Gutenberg header/licence are dropped when present (a no-op for other text)
        spec = CorpusSpec(name=p.name or str(p), description=f"local files at {p}", path=str(p.resolve()),
                          strip_gutenberg=True)
    if protocol is not None:
        if protocol not in PROTOCOLS:
            raise DataError(f"protocol {protocol!r} is not one of {PROTOCOLS}")
        spec = replace(spec, protocol=protocol)
    if text_field is not None:
        spec = replace(spec, text_field=text_field)
    return spec


def resolve_local_path(spec: CorpusSpec) -> Path:
    """The spec's local path: ``$path_env`` if set, else ``path`` (relative -> repository root)."""
    if spec.path_env and os.environ.get(spec.path_env):
        return Path(os.environ[spec.path_env]).expanduser()
    assert spec.path is not None
    p = Path(spec.path).expanduser()
    return p if p.is_absolute() else (repo_root() / p).resolve()


def iter_documents(spec: CorpusSpec, *, max_docs: int | None = None) -> Iterator[Document]:
    """Yield the corpus's documents in a fixed order (sorted files; stream order for hub data)."""
    it = _iter_local(spec) if spec.is_local else _iter_hub(spec)
    n = 0
    for doc in it:
        text = strip_gutenberg(doc.text) if spec.strip_gutenberg else doc.text
        if not text.strip():
            continue
        yield Document(doc.doc_id, text)
        n += 1
        if max_docs is not None and n >= max_docs:
            return


def list_local_files(spec: CorpusSpec) -> list[Path]:
    root = resolve_local_path(spec)
    if not root.exists():
        hint = f" (set ${spec.path_env} to where the files are)" if spec.path_env else ""
        raise DataError(f"dataset {spec.name!r}: {root} does not exist{hint}")
    if root.is_file():
        return [root]
    files: list[Path] = []
    if spec.files:
        for pattern in spec.files:
            matched = sorted(p for p in root.rglob("*") if p.is_file() and fnmatch.fnmatch(p.name, pattern))
            files.extend(p for p in matched if p not in files)
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
    if not files:
        raise DataError(f"dataset {spec.name!r}: no {'/'.join(spec.files or LOCAL_SUFFIXES)} files under {root}")
    return files


def _iter_local(spec: CorpusSpec) -> Iterator[Document]:
    files = list_local_files(spec)
    root = resolve_local_path(spec)
    for f in files:
        rel = f.name if root.is_file() else str(f.relative_to(root))
        if f.suffix == ".txt":  # the same policy as training: strict (error + byte offset) unless asked
            yield Document(rel, read_text(f))
            continue
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
                text = row.get(spec.text_field) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    raise DataError(
                        f"{f}:{i + 1}: no string field {spec.text_field!r} (pass --text-field to choose one)"
                    )
                yield Document(f"{rel}:{i + 1}", text)


def _iter_hub(spec: CorpusSpec) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - the eval extra ships datasets
        raise DataError("streaming hub datasets needs `datasets` (pip install 'retrofit[eval]')") from exc
    try:
        ds = datasets.load_dataset(
            spec.hub_id, name=spec.config, split=spec.split, data_files=spec.data_files, streaming=True
        )
        for i, row in enumerate(ds):
            text = row.get(spec.text_field)
            if not isinstance(text, str):
                raise DataError(
                    f"dataset {spec.name!r} ({spec.hub_id}): rows have no string field {spec.text_field!r}; "
                    f"fields are {sorted(row)}"
                )
            yield Document(f"{spec.split}:{i}", text)
    except DataError:
        raise
    except Exception as exc:  # network, missing split, gated repo...
        raise DataError(
            f"could not stream dataset {spec.name!r} ({spec.hub_id}, split={spec.split}): "
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
