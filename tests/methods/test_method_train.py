"""LAVO / LLP through the training pipeline (retrofit.train: DeepSpeed ZeRO-2 on one CPU rank):
LAVO trains its new weights only (with gradient checkpointing), LLP trains LoRA adapters
(the natural recipe for a method without new weights); both export a loadable folder."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import retrofit
from retrofit.layers.lavo import LavoAttention
from retrofit.layers.llp import LLPAttention
from retrofit.train import train
from retrofit.train.recipe import recipe_from_dict
from tests.train import tiny


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return tiny.save_base(tmp_path_factory.mktemp("methods-train") / "base")


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    return tiny.write_books(tmp_path_factory.mktemp("methods-books"), n=3, chars=4_000)


def test_lavo_trains_only_its_new_weights(base_dir, books, tmp_path):
    conversion = {"method": "lavo", "window": 8, "options": {"bases": 8}}
    recipe = recipe_from_dict(tiny.recipe_dict(
        base_dir, books, tmp_path / "run", conversion=conversion, trainable={"mode": "new"},
        train={"max_steps": 3, "lr": 1e-2, "gradient_checkpointing": True}, checkpoint={"save_every": 3}, eval={"sequences": 0},
    ))
    result = train(recipe)
    initial = retrofit.convert(tiny.base_model(), retrofit.ConversionSpec(**conversion))
    new = set(retrofit.surgery.new_parameter_names(initial))
    assert new and all(".lavo." in n for n in new)
    assert result.counts.trainable == sum(p.numel() for n, p in initial.named_parameters() if n in new)
    before, after = initial.state_dict(), _weights(result.final_dir)
    assert set(after) == set(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == new  # bases, relative bias and gate moved; every pretrained tensor is untouched
    loaded = retrofit.load(result.final_dir)
    assert isinstance(loaded.model.layers[0].self_attn, LavoAttention)


def test_llp_trains_lora_adapters_and_exports_a_merged_model(base_dir, books, tmp_path):
    conversion = {"method": "llp", "options": {"segment": 16}}
    recipe = recipe_from_dict(tiny.recipe_dict(
        base_dir, books, tmp_path / "run", conversion=conversion,
        trainable={"mode": "lora", "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
        train={"max_steps": 2, "lr": 1e-2, "gradient_checkpointing": False}, checkpoint={"save_every": 2}, eval={"sequences": 0},
    ))
    result = train(recipe)
    before, after = tiny.base_model().state_dict(), _weights(result.final_dir)
    assert set(after) == set(before)  # no new weights; LoRA merged back into the projections
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed)
    loaded = retrofit.load(result.final_dir)
    assert isinstance(loaded.model.layers[1].self_attn, LLPAttention) and loaded.config.retrofit["segment"] == 16
