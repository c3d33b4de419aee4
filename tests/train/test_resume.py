"""A run SIGKILLed between checkpoints resumes to exactly the losses and weights of an uninterrupted run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from retrofit.train.checkpointing import list_checkpoints
from retrofit.train import train
from retrofit.train.metrics import read_metrics
from retrofit.train.recipe import recipe_from_dict
from tests.train import tiny

REPO = Path(__file__).resolve().parents[2]

# the run to kill: a real subprocess, SIGKILLed (no cleanup, no final save) right after step KILL_AT
KILLED_RUN = """
import json, os, signal, sys
import torch
torch.set_num_threads(int(sys.argv[3]))
from retrofit.train import TrainCallback, train
from retrofit.train.recipe import recipe_from_dict

class Kill(TrainCallback):
    def on_step_end(self, step, metrics):
        if step == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)

train(recipe_from_dict(json.loads(open(sys.argv[1]).read())), callbacks=[Kill()])
"""


def _recipe(model, data, out):
    return tiny.recipe_dict(model, data, out, data={"holdout_last": 1, "shuffle_buffer": 6},
                            train={"max_steps": 8, "warmup_steps": 3, "gradient_checkpointing": False},
                            checkpoint={"save_every": 3, "keep_last": 3})


def test_killed_run_resumes_to_the_same_losses_and_weights(converted_dir, books, tmp_path):
    reference = train(recipe_from_dict(_recipe(converted_dir, books, tmp_path / "reference")))
    assert reference.steps == 8

    out = tmp_path / "run"
    spec = tmp_path / "recipe.json"
    spec.write_text(json.dumps(_recipe(converted_dir, books, out)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(spec), "5", str(torch.get_num_threads())],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(out)] == [3]  # steps 4 and 5 ran but were never saved
    assert not (out / "final").exists()
    # a save killed half-way leaves only a temporary folder, which is never resumed from
    from retrofit.fs.tempdirs import host_name

    dead_pid = 999_999_999  # above any pid_max: the writer is gone
    killed = [out / f".checkpoint-6.tmp-{dead_pid}-{host_name()}-0123abcd"]
    for folder in killed:
        (folder / "pytorch_model").mkdir(parents=True)

    resumed = train(recipe_from_dict(_recipe(converted_dir, books, out)))
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "checkpoint-3"
    assert [h["step"] for h in resumed.history] == [4, 5, 6, 7, 8]
    ref_loss = {h["step"]: h["loss"] for h in reference.history}
    assert all(h["loss"] == ref_loss[h["step"]] for h in resumed.history)  # bit-exact, not approximately
    assert [(r["step"], r["loss"], r["lr"]) for r in read_metrics(out / "metrics.jsonl", "train")] == \
           [(r["step"], r["loss"], r["lr"]) for r in read_metrics(tmp_path / "reference" / "metrics.jsonl", "train")]
    assert resumed.evals[-1]["loss"] == reference.evals[-1]["loss"]
    # metrics.jsonl across the kill: every record of the uninterrupted run, none twice
    assert [(r["kind"], r["step"]) for r in read_metrics(out / "metrics.jsonl")] == \
           [(r["kind"], r["step"]) for r in read_metrics(tmp_path / "reference" / "metrics.jsonl")]

    a, b = load_file(str(reference.final_dir / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [s for s, _ in list_checkpoints(out)] == [3, 6, 8]
    assert not any(folder.exists() for folder in killed)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary folder, trash or lock


class _Clock:
    """``perf_counter`` for the training loop alone: each call advances ``tick`` seconds."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    @staticmethod
    def time() -> float:
        import time

        return time.time()


def test_max_time_stops_saves_and_a_resume_keeps_the_time_already_spent(converted_dir, books, tmp_path, monkeypatch):
    from retrofit.train import loop

    monkeypatch.setattr(loop, "time", _Clock(5.0))  # a step = two readings = 5 s of training
    out = tmp_path / "run"
    timed = _recipe(converted_dir, books, out)
    timed["train"].update(max_steps=100, max_time=12.0, warmup_steps=1)
    timed["checkpoint"]["save_every"] = 100
    first = train(recipe_from_dict(timed))
    assert first.steps == 3 and (out / "final").is_dir()  # 5, 10, 15 s: the third step spends the budget
    assert [s for s, _ in list_checkpoints(out)] == [3]  # saved at the stop (save_every is 100)
    lrs = [h["lr"] for h in first.history]
    assert lrs[0] == 3e-3 and lrs[1] < lrs[0] and lrs[2] < lrs[1]  # the cosine follows the clock, not step/100
    assert lrs[2] < 0.5 * 3e-3  # 10 of 12 s spent before step 3: near the floor

    timed["train"]["max_time"] = 22.0  # two more steps' worth
    more = train(recipe_from_dict(timed))
    assert more.resumed_from is not None and [h["step"] for h in more.history] == [4, 5]
    assert [s for s, _ in list_checkpoints(out)][-1] == 5
