"""Checkpoint rotation and ``--overwrite`` delete only what retrofit wrote, as it wrote it."""
from __future__ import annotations

import json
import logging
import os

import pytest

from retrofit.errors import CheckpointError
from retrofit.fs.guard import check_replaceable, folder_files
from retrofit.train import checkpointing as ckpt


def _save(out, step: int) -> None:
    with ckpt.publishing(ckpt.checkpoint_dir(out, step)) as tmp:
        (tmp / "weights.bin").write_bytes(b"w" * 8)
        ckpt.write_state(tmp, {"step": step})


def test_rotation_keeps_checkpoints_holding_files_retrofit_did_not_write(tmp_path, caplog):
    out = tmp_path / "run"
    for step in (1, 2, 3, 4):
        _save(out, step)
    (out / "checkpoint-1" / "notes.txt").write_text("mine")                          # a user's note
    (out / "checkpoint-2" / "results.json").write_text("{}")                         # eval --out into it
    foreign = out / "checkpoint-0"                                                  # a folder retrofit never wrote
    foreign.mkdir()
    (foreign / ckpt.STATE_FILE).write_text(json.dumps({"step": 0}))
    (foreign / "model.safetensors").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        deleted = ckpt.rotate(out, keep_last=1)
    assert [p.name for p in deleted] == ["checkpoint-3"]
    assert (out / "checkpoint-1" / "notes.txt").read_text() == "mine"
    assert (out / "checkpoint-2" / "results.json").is_file() and (foreign / "model.safetensors").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-0", "checkpoint-1", "checkpoint-2", "checkpoint-4"]
    kept = " ".join(r.getMessage() for r in caplog.records)
    assert "notes.txt" in kept and "results.json" in kept and "checkpoint-0" in kept


def test_an_unreadable_sub_folder_makes_a_folder_irreplaceable(tmp_path, monkeypatch):
    """os.walk drops listing errors unless asked; a folder it cannot list may hold a user's files
    (root reads a chmod 000 folder, so the failure is injected where os.walk lists it)."""
    out = tmp_path / "run"
    _save(out, 1)
    folder = out / "checkpoint-1"
    (folder / "private").mkdir()
    (folder / "private" / "thesis.tex").write_text("years of work")
    real_scandir = os.scandir

    def scandir(path="."):
        if os.path.basename(os.fspath(path)) == "private":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    files, odd = folder_files(folder)
    assert "private/ (unreadable)" in odd
    with pytest.raises(CheckpointError, match="private"):
        check_replaceable(folder, overwrite=True)
    assert ckpt.rotate(out, keep_last=0) == [] and (folder / "private" / "thesis.tex").is_file()
