"""Fixtures for the training tests: a briefly pretrained tiny Llama, a random converted one, text files."""
from __future__ import annotations

import pytest
import torch

from tests.train import tiny


@pytest.fixture(scope="session")
def pretrained_base(tmp_path_factory):
    """A tiny Llama trained for 80 steps on a book, saved unconverted with its tokenizer.

    Its attention carries information (a random model's does not), so the converted model with
    most of p(.|t) on the untrained latent states is measurably worse and training only the new
    weights can win the loss back.
    """
    folder = tmp_path_factory.mktemp("pretrained-base")
    tok = tiny.tokenizer()
    ids = torch.tensor(tok(tiny.book_text(chars=60_000), verbose=False)["input_ids"])
    model = tiny.base_model(seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(80):
        starts = torch.randint(0, len(ids) - 33, (8,), generator=g)
        x = torch.stack([ids[s:s + 32] for s in starts])
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory):
    """A random tiny Llama converted to Macchiato and saved with retrofit.surgery.save."""
    return tiny.save_converted(tmp_path_factory.mktemp("converted") / "model")


@pytest.fixture(scope="session")
def books(tmp_path_factory):
    """Four short .txt documents from four books (held-out: the last by name)."""
    return tiny.write_books(tmp_path_factory.mktemp("books"), n=4, chars=6_000)


@pytest.fixture(scope="session")
def moby(tmp_path_factory):
    """Four consecutive slices of Moby Dick (the pretraining book) as .txt files."""
    folder = tmp_path_factory.mktemp("moby")
    text = (tiny.BOOKS / "moby-dick.txt").read_text(encoding="utf-8")
    for i in range(4):
        (folder / f"{i}.txt").write_text(text[100_000 + 8_000 * i: 100_000 + 8_000 * (i + 1)])
    return folder
