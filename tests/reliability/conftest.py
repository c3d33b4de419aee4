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
