"""Evaluation corpora: a registry of named datasets (configs/datasets.yaml) and local files.

A corpus is an iterator of :class:`Document` (an id and its text). Hub datasets are streamed
with `datasets` (never downloaded in full); local corpora are .txt files (one document each),
.jsonl/.json files (one document per line, ``text_field`` holds the text) or folders of them.
"""
from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retrofit.data.documents import Document, file_documents, hub_documents, strip_gutenberg  # re-exported
from retrofit.data.paths import expand_path
from retrofit.errors import DataError, SpecError
from retrofit.fs.guard import special_kind

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json")
PROTOCOLS = ("windows", "packed")


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
        try:
            p = expand_path(name_or_path, Path.cwd())  # a path, or bundled:NAME
        except SpecError as exc:
            raise DataError(str(exc)) from None
        kind = special_kind(p)
        if kind:  # /dev/null, a pipe: there, but no text files to read
            raise DataError(f"{name_or_path} is {kind}; pass a registry name (retrofit ls datasets) or a path to "
                            f"{'/'.join(LOCAL_SUFFIXES)} files or a folder of them")
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
    """The spec's local path: ``$path_env`` if set, else ``path`` (``bundled:NAME`` -> the package's
    data; another relative path -> the repository root)."""
    if spec.path_env and os.environ.get(spec.path_env):
        return Path(os.environ[spec.path_env]).expanduser()
    assert spec.path is not None
    try:
        return expand_path(spec.path, repo_root()).resolve()
    except SpecError as exc:
        raise DataError(f"dataset {spec.name!r}: {exc}") from None


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
    kind = special_kind(root)
    if kind:
        hint = f" (set ${spec.path_env} to the folder of its files)" if spec.path_env else ""
        raise DataError(f"dataset {spec.name!r}: {root} is {kind}{hint}")
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
        yield from file_documents(f, f.name if root.is_file() else str(f.relative_to(root)), spec.text_field)


def _iter_hub(spec: CorpusSpec) -> Iterator[Document]:
    assert spec.hub_id is not None
    yield from hub_documents(spec.name, spec.hub_id, config=spec.config, split=spec.split,
                             data_files=spec.data_files, text_field=spec.text_field)
