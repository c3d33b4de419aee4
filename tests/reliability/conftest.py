"""Fixtures shared by the reliability tests: a tiny base model folder and a few books to train on."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.train import tiny


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny Llama + tokenizer saved as a plain transformers folder (read-only for the tests)."""
    return tiny.save_base(tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture(scope="module")
def books(tmp_path_factory) -> Path:
    return tiny.write_books(tmp_path_factory.mktemp("books"), n=4, chars=3_000)


@pytest.fixture(autouse=True)
def only_this_tests_methods(monkeypatch):
    """Methods that other test modules register at collection make the package ``tests`` a plugin's: a test
    double raising from ``tests.*`` would read as that plugin's failure. Each reliability test sees the
    built-in methods and those it registers itself (into the copy, dropped afterwards)."""
    from retrofit.layers import method

    builtin = {name: info for name, info in method._METHODS.items()
               if (getattr(info.builder, "__module__", "") or "").split(".")[0] == "retrofit"}
    monkeypatch.setattr(method, "_METHODS", builtin)
