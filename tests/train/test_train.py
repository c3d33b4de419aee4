"""DeepSpeed runs of tiny converted models on the CPU (one gloo rank): what trains, what stays, what is saved."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import retrofit
from retrofit.cli.main import main as cli_main
from retrofit.errors import TrainingError
from retrofit.surgery import ConversionSpec, new_parameter_names
from retrofit.train.checkpointing import list_checkpoints
from retrofit.train import TrainCallback, train
from retrofit.train.metrics import read_metrics
from retrofit.train.recipe import recipe_from_dict
from tests.train import tiny


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_zero2_trains_only_the_new_weights_and_held_out_loss_drops(pretrained_base, moby, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    conversion = {**tiny.CONVERSION, "init_swa_share": 0.1}  # most of p(.|t) on the untrained latents
    recipe = recipe_from_dict(tiny.recipe_dict(
        pretrained_base, moby, out, conversion=conversion, data={"holdout_last": 1}, eval={"sequences": 8},
        train={"max_steps": 20, "lr": 3e-2, "gradient_checkpointing": False},
        checkpoint={"save_every": 10, "keep_last": 1}, logging={"every": 5, "tensorboard": True},
    ))
    result = train(recipe)

    # held-out loss on a fixed set of sequences: before training vs after 20 steps
    assert [e["step"] for e in result.evals] == [0, 20]
    assert result.evals[1]["loss"] < result.evals[0]["loss"] - 0.05, result.evals

    # the same conversion of the same base, untrained: frozen tensors bit-identical, new ones all moved
    initial = retrofit.convert(AutoModelForCausalLM.from_pretrained(pretrained_base), ConversionSpec(**conversion))
    new = set(new_parameter_names(initial))
    before = {k: v for k, v in initial.state_dict().items()}
    after = _weights(result.final_dir)
    assert set(after) == set(before)
    frozen_same = [k for k in before if k not in new and torch.equal(before[k], after[k])]
    assert len(frozen_same) == len(before) - len(new)
    assert all(not torch.equal(before[k], after[k]) for k in new)
    assert result.counts.trainable == sum(before[k].numel() for k in new)
    exported = retrofit.load(result.final_dir)
    assert type(exported).__name__ == "RetrofitLlamaForCausalLM" and exported.config.use_cache  # decoding config restored

    # optimizer state exists for the trainable weights only; the checkpoint holds no frozen weights
    [(step, ckpt)] = list_checkpoints(out)  # keep_last=1
    assert step == 20
    optim = torch.load(ckpt / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    fp32 = optim["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    assert sum(t.numel() for t in fp32) == result.counts.trainable
    module = torch.load(ckpt / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert set(module) == new

    rows = read_metrics(out / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["tokens"] == 20 * 4 * 32
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


class _Poison(TrainCallback):
    """Writes NaN into a trainable weight after step ``at`` (what a diverging update would do)."""

    def __init__(self, at: int):
        self.at, self.model = at, None

    def on_train_begin(self, model):
        self.model = model

    def on_step_end(self, step, metrics):
        if step == self.at:
            with torch.no_grad():
                next(p for p in self.model.parameters() if p.requires_grad).fill_(float("nan"))


@pytest.mark.parametrize("poison_at,message", [(3, "training loss is nan at step 4"), (2, "trainable weight is nan")])
def test_non_finite_values_stop_the_run_without_writing_anything_corrupt(converted_dir, books, tmp_path, poison_at, message):
    out = tmp_path / "run"
    recipe = recipe_from_dict(tiny.recipe_dict(converted_dir, books, out, train={"max_steps": 6, "gradient_checkpointing": False},
                                               checkpoint={"save_every": 2}))
    with pytest.raises(TrainingError, match=message) as info:
        train(recipe, callbacks=[_Poison(poison_at)])
    assert "stopped without saving" in str(info.value)
    assert [s for s, _ in list_checkpoints(out)] == ([2] if poison_at == 3 else [])
    assert not (out / "final").exists()
    assert not list(out.glob(".*checkpoint-*"))  # no temporary folder, trash or lock of a save
    for _, ckpt in list_checkpoints(out):
        module = torch.load(ckpt / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        assert all(torch.isfinite(t).all() for t in module.values())


def test_lora_with_gradient_checkpointing_exports_a_merged_loadable_model(converted_dir, books, tmp_path):
    recipe = recipe_from_dict(tiny.recipe_dict(
        converted_dir, books, tmp_path / "run", train={"max_steps": 2, "gradient_checkpointing": True, "lr": 1e-2},
        trainable={"mode": "lora", "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        checkpoint={"save_every": 2}, eval={"sequences": 0},
    ))
    result = train(recipe)
    before, after = _weights(converted_dir), _weights(result.final_dir)
    assert set(after) == set(before)  # LoRA merged away: same tensors as the converted model
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.endswith("q_proj.weight") for k in changed) and any(k.endswith("v_proj.weight") for k in changed)
    assert any("latent_q" in k for k in changed)  # the new weights train alongside the adapters
    assert not any(k.endswith(("k_proj.weight", "o_proj.weight", "mlp.up_proj.weight")) for k in changed)
    merged = retrofit.load(result.final_dir)
    card = (result.final_dir / "README.md").read_text()
    assert "library_name: retrofit" in card and "optimizer steps: 2" in card and "adapter" in card

    # a real PEFT adapter beside the merged model, the new weights in modules_to_save
    import json

    from peft import AutoPeftModelForCausalLM

    adapter = result.output_dir / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert (adapter / "adapter_model.safetensors").is_file()
    assert cfg["modules_to_save"] == ["latent_k", "latent_q"] and cfg["peft_type"] == "LORA"
    assert cfg["base_model_name_or_path"] == str((result.output_dir / "adapter-base").resolve())
    base = _weights(result.output_dir / "adapter-base")
    assert [k for k in before if not torch.equal(base[k], before[k])] == []  # the model the adapter was trained on
    peft_model = AutoPeftModelForCausalLM.from_pretrained(adapter)
    ids = torch.randint(3, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = merged(ids).logits
        assert torch.allclose(peft_model(input_ids=ids).logits, want, atol=1e-5, rtol=1e-4)
        remerged = peft_model.merge_and_unload()
        assert type(remerged).__name__ == type(merged).__name__
        assert torch.allclose(remerged(ids).logits, want, atol=1e-5, rtol=1e-4)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main(["train", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.err, captured.out


def test_cli_reports_bad_recipes_missing_data_and_impossible_lengths(converted_dir, books, tmp_path, capsys):
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny.recipe_dict(converted_dir, books, tmp_path / "out")))

    code, err, _ = _cli(capsys, path, "train.learning_rate=1e-4")
    assert code == 1 and "unknown recipe key 'train.learning_rate'" in err and "lr" in err and "warmup_steps" in err

    code, err, _ = _cli(capsys, path, "train.lr=fast")
    assert code == 1 and "train.lr must be a number" in err

    code, err, _ = _cli(capsys, path, f"data.files={tmp_path / 'no-such-books'}")
    assert code == 1 and "does not exist" in err and "no-such-books" in err

    code, err, _ = _cli(capsys, path, "data.seq_len=2147483648")
    assert code == 1 and "needs at least" in err and "GiB" in err and "lower data.seq_len" in err
    assert not (tmp_path / "out").exists()

    code, _, out = _cli(capsys, "--print-recipe", path, "train.lr=1e-4")
    assert code == 0 and "lr: 0.0001" in out


def test_zero3_held_out_loss_gathers_the_partitioned_head(pretrained_base, moby, tmp_path):
    """Under ZeRO-3 every weight is partitioned (persistence threshold 0): the held-out loss gathers
    the LM head around the blockwise cross-entropy and equals the ZeRO-2 run's on the same data."""
    import json
    from pathlib import Path

    ds3 = tmp_path / "zero3_all_partitioned.json"
    cfg = json.loads((Path(__file__).resolve().parents[2] / "configs" / "deepspeed" / "zero3.json").read_text())
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds3.write_text(json.dumps(cfg))
    evals = {}
    for name, ds in (("zero2", "deepspeed/zero2.json"), ("zero3", str(ds3))):
        recipe = recipe_from_dict(tiny.recipe_dict(
            pretrained_base, moby, tmp_path / name, deepspeed={"config": ds}, data={"holdout_last": 1},
            eval={"sequences": 4}, train={"max_steps": 1}, checkpoint={"save_every": 1},
        ))
        evals[name] = train(recipe).evals
    assert evals["zero3"][0]["loss"] == pytest.approx(evals["zero2"][0]["loss"], rel=1e-5)
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in evals["zero3"])


def test_one_rank_skips_the_shared_memory_collective_build(pretrained_base, moby, tmp_path):
    """A one-rank run never JIT-compiles DeepSpeed's CPU shared-memory all-reduce (a ~35 s C++ build
    per fresh environment); DeepSpeed's own table is restored afterwards, and several ranks keep it."""
    import deepspeed.comm.comm as ds_comm
    import deepspeed.ops

    from retrofit.train.distributed import no_shared_memory_comm

    table = deepspeed.ops.__compatible_ops__
    before = dict(table)
    with no_shared_memory_comm(2):
        assert table == before
    with no_shared_memory_comm(1):
        assert table["deepspeed_shm_comm"] is False
    assert table == before
    recipe = recipe_from_dict(tiny.recipe_dict(
        pretrained_base, moby, tmp_path / "run", train={"max_steps": 1}, checkpoint={"save_every": 1},
    ))
    train(recipe)
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    assert table == before
