"""Tiny models decode token by token here; on a shared 2-core box two intra-op threads make such
loops many times slower, so these tests run on one thread.
"""
import pytest

from tests.train import tiny


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test in this folder uses the shared ``one_thread`` fixture (tests/conftest.py)."""
    yield


@pytest.fixture(scope="module")
def train_inputs(tmp_path_factory):
    """``(base folder, books folder)`` for the training tests: a tiny unconverted Llama with its
    tokenizer, and three short .txt documents."""
    folder = tmp_path_factory.mktemp("methods-train")
    return tiny.save_base(folder / "base"), tiny.write_books(folder / "books", n=3, chars=4_000)
