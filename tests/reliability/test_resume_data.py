"""A resume reads the data the checkpoint was trained on: the same files, each with the same content."""
from __future__ import annotations

import json
import shutil

import pytest

from retrofit.cli.main import main
from tests.reliability.test_faults import fails, leftovers, recipe_file

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture
def resumable(tmp_path, base, books):
    """A 1-step run with its checkpoint-1, trained on a private copy of the books: (recipe, books, output)."""
    shutil.copytree(books, tmp_path / "books")
    recipe = recipe_file(tmp_path, base, tmp_path / "books", train={"max_steps": 1},
                         checkpoint={"save_every": 1, "export": False}, eval={"sequences": 0})
    assert main(["train", str(recipe)]) == 0
    return recipe, tmp_path / "books", tmp_path / "out"


def _refused(recipe, out, capsys, *needles):
    fails(["train", str(recipe), "train.max_steps=2"], capsys, "was trained on other data", *needles)
    assert not (out / "checkpoint-2").exists() and not leftovers(out)


def test_resume_refuses_rewritten_data_files_at_the_same_paths(resumable, capsys):
    recipe, books, out = resumable
    for f in sorted(books.iterdir()):  # same paths, other text of the same length
        f.write_text(f.read_text()[::-1])
    _refused(recipe, out, capsys, "same size, other content", "start fresh")


def test_resume_refuses_an_added_or_removed_data_file(resumable, capsys):
    recipe, books, out = resumable
    first = sorted(books.iterdir())[0]
    shutil.copy(first, books / "zz-added.txt")
    _refused(recipe, out, capsys, "zz-added.txt", "was added")
    (books / "zz-added.txt").unlink()
    first.unlink()
    _refused(recipe, out, capsys, first.name, "is gone")


def test_resume_refuses_a_grown_file_and_a_state_without_its_data_digest(resumable, capsys):
    recipe, books, out = resumable
    first = sorted(books.iterdir())[0]
    original = first.read_bytes()
    first.write_bytes(original + b" more")
    _refused(recipe, out, capsys, first.name, "bytes then")
    first.write_bytes(original)
    state_file = out / "checkpoint-1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["data_digest"]
    state_file.write_text(json.dumps(state))
    fails(["train", str(recipe), "train.max_steps=2"], capsys, "has no data digest", "start fresh")


def test_a_resume_on_unchanged_data_continues(resumable, capsys):
    recipe, _, out = resumable
    assert main(["train", str(recipe), "train.max_steps=2"]) == 0
    assert "resuming from checkpoint-1" in capsys.readouterr().out
    assert (out / "checkpoint-2").is_dir()
