"""Dataset registry and document readers (local files, and the hub path through `datasets`)."""
from __future__ import annotations

import json

import pytest

from retrofit.data.paths import bundled_data_dir
from retrofit.errors import DataError
from retrofit.eval import corpora

PAPER_NAMES = ("slimpajama", "pile", "openwebtext", "tinystories", "pg19", "pg-books")


def test_registry_maps_every_paper_dataset():
    reg = corpora.load_registry()
    for name in PAPER_NAMES:
        assert name in reg, name
    assert reg["slimpajama"].hub_id == "cerebras/SlimPajama-627B" and reg["slimpajama"].split == "validation"
    assert reg["pile"].hub_id == "monology/pile-uncopyrighted"
    assert reg["pg-books"].is_local and reg["pg-books"].path == "bundled:pg-books"
    for spec in reg.values():
        assert spec.protocol in corpora.PROTOCOLS and spec.text_field


def test_pg_books_ship_in_the_package_and_strip_gutenberg():
    spec = corpora.resolve_corpus("pg-books")
    root = corpora.resolve_local_path(spec)
    assert root == (bundled_data_dir() / "pg-books").resolve() and root.is_dir()
    assert corpora.resolve_local_path(corpora.resolve_corpus("bundled:pg-books/jack-sheppard.txt")) == root / "jack-sheppard.txt"
    docs = list(corpora.iter_documents(spec))
    assert [d.doc_id for d in docs] == sorted(p.name for p in root.glob("*.txt"))
    for d in docs:
        assert "START OF TH" not in d.text[:2000] and "Project Gutenberg-tm" not in d.text
        assert len(d.text) > 100_000
    held = [d.doc_id for d in corpora.iter_documents(corpora.resolve_corpus("pg-books-heldout"))]
    assert held == ["jack-sheppard.txt", "complete-angler.txt"]


def test_env_override_and_missing_folder(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("alpha " * 10)
    (tmp_path / "b.txt").write_text("beta " * 10)
    reg = {"mine": corpora.CorpusSpec(name="mine", path="bundled:pg-books", path_env="MY_BOOKS")}
    monkeypatch.setenv("MY_BOOKS", str(tmp_path))
    docs = list(corpora.iter_documents(corpora.resolve_corpus("mine", registry=reg)))
    assert [d.doc_id for d in docs] == ["a.txt", "b.txt"]
    monkeypatch.setenv("MY_BOOKS", str(tmp_path / "nope"))
    with pytest.raises(DataError, match="MY_BOOKS"):
        list(corpora.iter_documents(corpora.resolve_corpus("mine", registry=reg)))


@pytest.mark.parametrize("bad", ["bundled:", "bundled:../paths.py", "bundled:pg-books/../../x"])
def test_bundled_paths_stay_inside_the_package_data(bad):
    with pytest.raises(DataError, match="bundled:NAME"):
        corpora.resolve_corpus(bad)


def test_local_jsonl_folder_and_text_field(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "x.jsonl").write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(3)) + "\n")
    (folder / "y.txt").write_text("a plain text document")
    (folder / "skip.csv").write_text("ignored")
    spec = corpora.resolve_corpus(str(folder), text_field="body")
    docs = list(corpora.iter_documents(spec))
    assert [d.doc_id for d in docs] == ["x.jsonl:1", "x.jsonl:2", "x.jsonl:3", "y.txt"]
    assert docs[1].text == "doc 1"
    with pytest.raises(DataError, match="--text-field"):
        list(corpora.iter_documents(corpora.resolve_corpus(str(folder))))
    assert len(list(corpora.iter_documents(spec, max_docs=2))) == 2


def test_unknown_name_lists_registry():
    with pytest.raises(DataError, match="slimpajama"):
        corpora.resolve_corpus("no-such-corpus")
    with pytest.raises(DataError, match="protocol"):
        corpora.resolve_corpus("pg-books", protocol="sliding")


def test_hub_path_streams_through_datasets(tmp_path):
    """The hub code path (datasets.load_dataset(..., streaming=True)) on a local jsonl file."""
    f = tmp_path / "val.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(5)) + "\n")
    spec = corpora.CorpusSpec(name="local-hub", hub_id="json", data_files={"validation": str(f)}, split="validation")
    docs = list(corpora.iter_documents(spec, max_docs=4))
    assert [d.text for d in docs] == [f"row {i}" for i in range(4)]
    assert docs[0].doc_id == "validation:0"
    bad = corpora.CorpusSpec(name="bad", hub_id="json", data_files={"validation": str(f)}, split="validation",
                             text_field="missing")
    with pytest.raises(DataError, match="missing"):
        list(corpora.iter_documents(bad))


def test_strip_gutenberg_variants():
    text = "header\n*** START OF THIS BOOK ***\nbody text\nEnd of Project Gutenberg's Book\n*** END OF IT ***\nlicence"
    assert corpora.strip_gutenberg(text) == "body text"
    assert corpora.strip_gutenberg("no markers here") == "no markers here"


def test_local_gutenberg_file_is_stripped(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("The Project Gutenberg EBook\n*** START OF THIS BOOK ***\nChapter 1.\n*** END OF THIS BOOK ***\nlicence")
    assert [d.text for d in corpora.iter_documents(corpora.resolve_corpus(str(f)))] == ["Chapter 1."]
