"""Loader for the retrofit_tiny tasks: jsonl files next to this file (no download, no cwd games).

lm-eval resolves ``!function utils.load_split_files`` relative to the YAML, and calls it with the
task's ``dataset_kwargs`` (here ``prefix``) and metadata.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_split_files(prefix: str, **_):
    """``{prefix}_{split}.jsonl`` -> a DatasetDict with one split per file found."""
    import datasets

    splits = {}
    for split in ("train", "validation", "test"):
        f = HERE / f"{prefix}_{split}.jsonl"
        if f.is_file():
            rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
            splits[split] = datasets.Dataset.from_list(rows)
    if not splits:
        raise FileNotFoundError(f"no {prefix}_*.jsonl files in {HERE}")
    return datasets.DatasetDict(splits)
