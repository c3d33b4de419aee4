"""Multi-stage recipes (attention transfer, then KL): one launch, stage chaining, bit-exact resume."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from retrofit.errors import CheckpointError, SpecError
from retrofit.train import TrainCallback, train
from retrofit.train.recipe import recipe_from_dict
from tests.train import tiny

STAGES = [{"name": "transfer", "train": {"objective": "attention", "max_steps": 4, "lr": 1e-2}},
          {"name": "kl", "train": {"objective": "mix", "objective_weights": {"kl": 1.0, "attention": 0.5},
                                   "max_steps": 4}}]


def _recipe(model, data, out, stages=STAGES):
    d = tiny.recipe_dict(model, data, out, data={"holdout_last": 1, "shuffle_buffer": 6},
                         train={"max_steps": 4, "warmup_steps": 1, "gradient_checkpointing": False},
                         checkpoint={"save_every": 2, "keep_last": 2})
    d["stages"] = stages
    return d


class _Stop(TrainCallback):
    def __init__(self, at_step: int):
        self.at = at_step

    def on_step_end(self, step, metrics):
        if "loss_kl" in metrics and step == self.at:
            raise KeyboardInterrupt  # a crash inside the second stage


def test_two_stages_chain_and_resume_bit_exactly(pretrained_base, books, tmp_path):
    ref = train(recipe_from_dict(_recipe(pretrained_base, books, tmp_path / "ref")))
    assert [s["stage"] for s in ref.stages] == ["stage-1-transfer", "stage-2-kl"]
    first = (tmp_path / "ref" / "stage-1-transfer")
    assert (first / "final").is_dir() and (first / "DONE").is_file()
    link = tmp_path / "ref" / "final"  # the result where a single-stage run puts it
    assert link.is_symlink() and link.resolve() == (tmp_path / "ref" / "stage-2-kl" / "final").resolve()
    assert not Path(os.readlink(link)).is_absolute()  # the folder can move
    assert "loss_attention" in ref.history[0] and "loss_kl" in ref.history[0]
    s1, s2 = ref.stages
    assert s2["evals"][0]["loss"] == s1["evals"][-1]["loss"]  # stage 2 starts from stage 1's trained weights
    assert s1["evals"][-1]["loss"] != s1["evals"][0]["loss"]  # which stage 1 did change

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(recipe_from_dict(_recipe(pretrained_base, books, out)), callbacks=[_Stop(3)])
    resumed = train(recipe_from_dict(_recipe(pretrained_base, books, out)))
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "checkpoint-2"
    ref_loss = {h["step"]: h["loss"] for h in ref.history}
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert all(h["loss"] == ref_loss[h["step"]] for h in resumed.history)
    a = load_file(str(ref.final_dir / "model.safetensors"))
    b = load_file(str(resumed.final_dir / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    again = train(recipe_from_dict(_recipe(pretrained_base, books, out)))  # all finished: nothing reruns
    assert again.history == [] and [s["stage"] for s in again.stages] == ["stage-1-transfer", "stage-2-kl"]

    changed = [STAGES[0], {**STAGES[1], "train": {**STAGES[1]["train"], "max_steps": 6}}]
    with pytest.raises(CheckpointError, match="different multi-stage recipe"):
        train(recipe_from_dict(_recipe(pretrained_base, books, out, changed)))


@pytest.mark.parametrize("stages, match", [
    ([{"model": {"name": "x"}}], "model"),
    ([{"checkpoint": {"output_dir": "x"}}], "output_dir"),
    ([{"name": "a"}, {"name": "b", "conversion": {"method": "macchiato"}}], "only the first stage converts"),
    ([{"name": "a"}, {"name": "a"}], "two stages are named"),
    ([{"train": {"objective": "nope"}}], "train.objective"),
    (["transfer"], "must be a mapping"),
])
def test_bad_stage_lists_fail_before_any_weight_is_loaded(stages, match, tmp_path):
    with pytest.raises(SpecError, match=match):
        recipe_from_dict(_recipe(tmp_path / "no-model-here", tmp_path / "books", tmp_path / "out", stages))


def test_the_loop_runs_one_recipe_and_train_runs_stages(tmp_path):
    from retrofit.train.loop import run_recipe

    staged = recipe_from_dict(_recipe(tmp_path / "no-model-here", tmp_path / "books", tmp_path / "out", STAGES))
    with pytest.raises(ValueError, match="retrofit.train.train"):
        run_recipe(staged)


def test_attention_objective_needs_a_converted_model(pretrained_base, books, tmp_path):
    d = tiny.recipe_dict(pretrained_base, books, tmp_path / "out", data={"holdout_last": 1},
                         train={"max_steps": 1, "objective": "attention"})
    d["conversion"] = {}
    with pytest.raises(SpecError, match="conversion"):
        train(recipe_from_dict(d))
