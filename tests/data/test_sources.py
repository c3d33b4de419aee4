"""Local data files: folders, globs, lists, hold-out by name, formats and clear errors."""
from __future__ import annotations

import pytest

from retrofit.data.paths import expand_path
from retrofit.data.sources import load_documents, resolve_files, split_holdout
from retrofit.errors import DataError, SpecError


def _touch(folder, *names):
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_text(f"text of {n}")
    return folder


def test_folder_glob_and_list_sorted_by_file_name(tmp_path):
    d = _touch(tmp_path / "books", "b.txt", "a.txt", "c.txt", "README.md")
    assert [f.name for f in resolve_files(d)] == ["a.txt", "b.txt", "c.txt"]  # README.md is not data
    assert [f.name for f in resolve_files("books/*.txt", tmp_path)] == ["a.txt", "b.txt", "c.txt"]
    assert [f.name for f in resolve_files(["books/c.txt", "books/a.txt"], tmp_path)] == ["a.txt", "c.txt"]
    train, held = split_holdout(resolve_files(d), 2)
    assert [f.name for f in train] == ["a.txt"] and [f.name for f in held] == ["b.txt", "c.txt"]


def test_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        resolve_files("nowhere/books", tmp_path)
    with pytest.raises(DataError, match="no data files match"):
        resolve_files(str(tmp_path / "*.parquet"))
    with pytest.raises(DataError, match="holds no"):
        resolve_files(_touch(tmp_path / "empty", "notes.md"))
    with pytest.raises(DataError, match="unsupported data file"):
        resolve_files(_touch(tmp_path / "x", "a.csv") / "a.csv")
    with pytest.raises(DataError, match="leaves no training files"):
        split_holdout(resolve_files(_touch(tmp_path / "two", "a.txt", "b.txt")), 2)
    mixed = _touch(tmp_path / "mixed", "a.txt", "b.jsonl")
    with pytest.raises(DataError, match="mix formats"):
        load_documents(files=resolve_files(mixed))


def test_env_expansion_then_relative_to_base(tmp_path, monkeypatch):
    monkeypatch.delenv("RETROFIT_TEST_DATA", raising=False)
    assert expand_path("${RETROFIT_TEST_DATA:-../d}/x", tmp_path) == tmp_path / "../d/x"
    monkeypatch.setenv("RETROFIT_TEST_DATA", str(tmp_path / "elsewhere"))
    assert expand_path("${RETROFIT_TEST_DATA:-../d}/x", "/ignored") == tmp_path / "elsewhere" / "x"
    monkeypatch.delenv("RETROFIT_TEST_DATA")
    with pytest.raises(SpecError, match="RETROFIT_TEST_DATA"):
        expand_path("${RETROFIT_TEST_DATA}/x", tmp_path)


def test_txt_is_one_document_per_file_and_jsonl_one_per_line(tmp_path):
    (tmp_path / "a.txt").write_text("line one\nline two\n")
    (tmp_path / "b.txt").write_text("other book")
    docs = list(load_documents(files=resolve_files(["a.txt", "b.txt"], tmp_path)))
    assert [d["text"] for d in docs] == ["line one\nline two\n", "other book"]
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n')
    assert [d["body"] for d in load_documents(files=[tmp_path / "c.jsonl"], text_field="body")] == ["x", "y"]
