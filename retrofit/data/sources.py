"""Where documents come from: a streamed hub dataset (SlimPajama by default) or local files.

Both paths go through ``datasets.load_dataset(..., streaming=True)`` and give an
``IterableDataset`` of ``{text_field: str}`` documents, so the packing and sharding code
downstream is the same for SlimPajama and for a folder of books.

Local formats, chosen by extension: ``.txt`` (one file = one document), ``.jsonl`` /
``.json`` (one record = one document, text in ``text_field``) and ``.parquet``.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Sequence

from retrofit.data.paths import expand_path
from retrofit.errors import DataError
from retrofit.fs.guard import special_kind

__all__ = ["resolve_files", "split_holdout", "load_documents", "shard_documents", "LOCAL_FORMATS"]

LOCAL_FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def resolve_files(spec: Any, base_dir: str | os.PathLike = ".") -> list[Path]:
    """A file, folder, glob or list of them -> existing data files sorted by file name.

    Folders contribute their files with a known extension (non-recursive); names are
    sorted alphabetically (by file name, then path) so "the last N files" is well defined.
    """
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    files: list[Path] = []
    for item in items:
        if item is None or not str(item).strip():  # an empty path is the base folder: every file in it would be read
            raise DataError(f"the data files name an empty path ({item!r}); give a file, folder or glob "
                            "(e.g. data.files=/path/to/*.jsonl)")
        p = expand_path(str(item), base_dir)
        if any(ch in str(p) for ch in "*?["):
            matches = [Path(m) for m in glob.glob(str(p))]
            if not matches:
                raise DataError(f"no data files match {str(p)!r}")
            files += [m for m in matches if m.is_file()]
        elif p.is_dir():
            found = [f for f in p.iterdir() if f.is_file() and f.suffix.lower() in LOCAL_FORMATS]
            if not found:
                raise DataError(f"data folder {p} holds no {'/'.join(LOCAL_FORMATS)} files")
            files += found
        elif p.is_file():
            files.append(p)
        elif special_kind(p):  # /dev/null, a pipe: there, but nothing to read documents from
            raise DataError(f"data file {p} is {special_kind(p)}; give {'/'.join(LOCAL_FORMATS)} files or a folder "
                            "of them (data.files=/path/to/files)")
        else:
            raise DataError(f"data file {p} does not exist (data paths resolve against the recipe's folder; "
                            "override with data.files=/path/to/files or the ${VAR:-default} form in the recipe)")
    files = sorted(set(files), key=lambda f: (f.name, str(f)))
    bad = [f for f in files if f.suffix.lower() not in LOCAL_FORMATS]
    if bad:
        raise DataError(f"unsupported data file {bad[0]}: use {', '.join(LOCAL_FORMATS)} files")
    return files


def split_holdout(files: Sequence[Path], holdout_last: int) -> tuple[list[Path], list[Path]]:
    """``(train, held_out)``: the last ``holdout_last`` files (already sorted by name) are held out."""
    files = list(files)
    if holdout_last == 0:
        return files, []
    if holdout_last >= len(files):
        raise DataError(f"data.holdout_last={holdout_last} leaves no training files out of {len(files)}: "
                        f"{', '.join(f.name for f in files)}")
    return files[:-holdout_last], files[-holdout_last:]


def load_documents(
    *,
    files: Sequence[Path] | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    errors: str = "strict",
) -> Any:
    """A streamed ``datasets.IterableDataset`` of documents with a ``text_field`` column.

    ``files`` (local, one format) take precedence over ``dataset`` (a hub id, streamed).
    ``errors``: how local txt/jsonl bytes that are not UTF-8 decode (``strict`` | ``replace``;
    :func:`retrofit.data.text.check_utf8` turns strict failures into an error with the byte offset).
    """
    from retrofit.extras import require

    datasets = require("datasets", "training data")

    if files:
        formats = {LOCAL_FORMATS[Path(f).suffix.lower()] for f in files}
        if len(formats) > 1:
            raise DataError(f"data files mix formats ({', '.join(sorted(formats))}); use one format per run")
        fmt = formats.pop()
        if fmt == "parquet":
            for f in files:
                _check_parquet(Path(f))
        kwargs: dict[str, Any] = {"sample_by": "document"} if fmt == "text" else {}
        if fmt in ("text", "json"):
            kwargs["encoding_errors"] = errors
        ds = datasets.load_dataset(fmt, data_files={"train": [str(f) for f in files]}, split="train",
                                   streaming=True, **kwargs)
        if fmt == "text" and text_field != "text":
            ds = ds.rename_column("text", text_field)
        return ds
    if not dataset:
        raise DataError("no data: set data.files (local txt/jsonl/parquet) or data.dataset (a hub dataset id)")
    try:
        return datasets.load_dataset(dataset, dataset_config, split=split, streaming=True)
    except Exception as exc:  # network, unknown dataset or split: one clear message
        raise DataError(f"cannot stream {dataset!r} (split {split!r}): {type(exc).__name__}: {exc}. "
                        "Without hub access, train on local files: data.files=/path/to/*.jsonl") from None


def _check_parquet(path: Path) -> None:
    """``path`` opens as a Parquet file (footer and schema), else one DataError: the reader's own error came
    out of the streamed dataset's first read, mid-run, as a traceback."""
    import pyarrow.parquet as pq

    try:
        pq.ParquetFile(path).close()
    except Exception as exc:  # pyarrow's ArrowInvalid and kin: a truncated, corrupt or renamed file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{path}: not a readable Parquet file ({reason}); replace it with a complete .parquet file "
                        "or leave it out of the data files") from None


def shard_documents(documents: Any, rank: int, world_size: int) -> Any:
    """This data-parallel rank's disjoint part of the documents.

    ``datasets.distributed.split_dataset_by_node``: whole files (shards) per rank when
    their number divides by ``world_size``, otherwise every ``world_size``-th document.
    """
    if world_size == 1:
        return documents
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(documents, rank=rank, world_size=world_size)
