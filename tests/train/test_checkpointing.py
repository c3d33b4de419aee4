"""Checkpoints publish through retrofit.fs.atomic_directory; metrics.jsonl holds every step once across resumes."""
from __future__ import annotations

import json
import os

import pytest

from retrofit.fs.guard import MANIFEST
from retrofit.train import checkpointing as ckpt
from retrofit.train.metrics import MetricsLogger, read_metrics


class Boom(Exception):
    pass


def _save(out, step, *, payload=b"w", fail=False):
    with ckpt.publishing(ckpt.checkpoint_dir(out, step)) as tmp:
        (tmp / "pytorch_model").mkdir()
        with open(tmp / "pytorch_model" / "w.bin", "wb") as fh:  # what DeepSpeed writes inside the folder
            fh.write(payload)
        if fail:
            raise Boom
        ckpt.write_state(tmp, {"step": step})
    return ckpt.checkpoint_dir(out, step)


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_a_checkpoint_appears_whole_or_not_at_all(tmp_path):
    with pytest.raises(Boom):
        _save(tmp_path, 3, fail=True)
    assert _names(tmp_path) == [] and ckpt.list_checkpoints(tmp_path) == []
    final = _save(tmp_path, 3)
    assert _names(tmp_path) == ["checkpoint-3"] and ckpt.read_state(final) == {"step": 3}
    assert set(json.loads((final / MANIFEST).read_text())["files"]) == {"pytorch_model/w.bin", ckpt.STATE_FILE}


def test_a_step_saved_again_replaces_the_older_folder_only_once_complete(tmp_path):
    _save(tmp_path, 6, payload=b"old")
    with pytest.raises(Boom):
        _save(tmp_path, 6, payload=b"new", fail=True)
    assert (tmp_path / "checkpoint-6" / "pytorch_model" / "w.bin").read_bytes() == b"old"
    _save(tmp_path, 6, payload=b"new")
    assert (tmp_path / "checkpoint-6" / "pytorch_model" / "w.bin").read_bytes() == b"new"
    assert _names(tmp_path) == ["checkpoint-6"]


def test_an_earlier_versions_checkpoint_is_still_resumable_and_replaceable(tmp_path):
    legacy = tmp_path / "checkpoint-6"  # written before checkpoints had a manifest
    (legacy / "pytorch_model").mkdir(parents=True)
    (legacy / ckpt.STATE_FILE).write_text(json.dumps({"step": 6}))
    assert ckpt.latest_checkpoint(tmp_path) == legacy and ckpt.read_state(legacy) == {"step": 6}
    _save(tmp_path, 6, payload=b"new")
    assert (legacy / "pytorch_model" / "w.bin").read_bytes() == b"new" and _names(tmp_path) == ["checkpoint-6"]


def test_rotation_and_the_clean_up_of_killed_saves(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    assert [p.name for p in ckpt.rotate(tmp_path, 2)] == ["checkpoint-1"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    dead = "999999999"  # no such process: its save was killed
    from retrofit.fs.tempdirs import host_name

    killed = tmp_path / f".checkpoint-4.tmp-{dead}-{host_name()}-0123abcd"
    live = tmp_path / f".checkpoint-7.tmp-{os.getpid()}-{host_name()}-0123abcd"
    for p in (killed, live):
        (p / "pytorch_model").mkdir(parents=True)
    ckpt.clean_stale(tmp_path)
    assert _names(tmp_path) == [live.name, "checkpoint-2", "checkpoint-3"]


def _logger(out, resume_step):
    return MetricsLogger(out, enabled=True, tensorboard=False, wandb=False, wandb_project="", run_name="r",
                         config={}, resume_step=resume_step)


def test_metrics_hold_every_step_once_across_resumes(tmp_path):
    log = _logger(tmp_path, None)
    for step in range(4):
        log.log("train", step, {"loss": float(step)})
    log.sync()
    with open(log.path, "ab") as fh:  # killed mid-line after step 3
        fh.write(b'{"kind": "train", "st')
    log = _logger(tmp_path, 2)  # resumed from checkpoint-2: steps 3 on are logged again
    for step in range(3, 6):
        log.log("train", step, {"loss": float(step)})
    assert [r["step"] for r in read_metrics(log.path)] == [0, 1, 2, 3, 4, 5]
    _logger(tmp_path, 5).log("eval", 5, {"loss": 0.5})  # resumed from the last checkpoint: nothing goes
    assert [(r["kind"], r["step"]) for r in read_metrics(log.path)][-2:] == [("train", 5), ("eval", 5)]
    _logger(tmp_path, None).log("train", 1, {"loss": 1.0})  # started afresh (no checkpoint): a new run's log
    assert [r["step"] for r in read_metrics(log.path)] == [1]


def test_a_resave_killed_between_its_swap_renames_gives_its_checkpoint_back(tmp_path):
    from retrofit.fs.tempdirs import SWAP_KIND, host_name

    _save(tmp_path, 6, payload=b"new")
    swap = tmp_path / f".checkpoint-6.{SWAP_KIND}-999999999-{host_name()}-0123abcd"  # its writer is gone
    swap.mkdir()
    (tmp_path / "checkpoint-6").rename(swap / "new")  # killed after moving the new folder in, the old one out
    assert ckpt.list_checkpoints(tmp_path) == []
    ckpt.clean_stale(tmp_path)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [6] and _names(tmp_path) == ["checkpoint-6"]
    assert (tmp_path / "checkpoint-6" / "pytorch_model" / "w.bin").read_bytes() == b"new"
