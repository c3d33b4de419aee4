"""Recipes: the bundled ones load, keys are checked, overrides are typed, paths resolve; DeepSpeed JSON; LR schedule."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from retrofit.data.paths import bundled_data_dir
from retrofit.data.sources import resolve_files
from retrofit.errors import SpecError
from retrofit.surgery import ConversionSpec
from retrofit.train.distributed import deepspeed_config
from retrofit.train.loop import total_steps
from retrofit.train.recipe import bundled_recipe_dir, load_recipe, recipe_from_dict
from retrofit.train.schedule import lr_at

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BOOKS = bundled_data_dir() / "pg-books"  # where the CPU recipes find their data, in a clone or a wheel


def test_bundled_recipes_are_the_repo_configs():
    assert bundled_recipe_dir() == CONFIGS.resolve()


TRAINING_RECIPES = sorted(p.name for p in CONFIGS.glob("*.yaml") if "train" in (yaml.safe_load(p.read_text()) or {}))


@pytest.mark.parametrize("name", TRAINING_RECIPES)
def test_every_bundled_training_recipe_loads(name):
    r = load_recipe(CONFIGS / name)
    r.validate()
    assert r.train.max_steps or r.train.max_tokens or r.stages  # a length, here or per stage


def test_gpu_hybrid_recipe_is_the_cpu_hybrid_conversion_in_bf16():
    gpu, cpu = load_recipe(CONFIGS / "gemma3-270m-hybrid-gpu.yaml"), load_recipe(CONFIGS / "gemma3-270m-hybrid-cpu.yaml")
    assert gpu.conversion == cpu.conversion
    assert (gpu.train.precision, gpu.model.dtype, gpu.data.seq_len) == ("bf16", "bfloat16", 16384)


def test_demo_recipe_is_the_keep_retrieval_conversion():
    from retrofit.demo import DEFAULT_RECIPE

    demo = load_recipe(CONFIGS / DEFAULT_RECIPE)
    spec = yaml.safe_load((CONFIGS / "convert-gemma3-270m-keep-retrieval.yaml").read_text())
    assert demo.conversion == spec
    assert demo.conversion["layers"] == [17] and demo.conversion["rope_cap"] == 32767


def test_paper_recipe_is_table_7():
    r = load_recipe(CONFIGS / "gemma2-2b-macchiato.yaml")
    spec = ConversionSpec.from_dict(r.conversion)
    assert (spec.method, spec.window, spec.latents) == ("macchiato", 128, 128)
    t = r.train
    assert (t.lr, t.warmup_steps, t.schedule, t.max_steps, t.batch_size, r.data.seq_len) == (6e-4, 2000, "cosine", 100_000, 4, 4096)
    assert r.data.dataset == "cerebras/SlimPajama-627B" and r.data.split == "train" and r.data.files is None
    assert r.trainable.mode == "new"
    cfg = deepspeed_config(r, world_size=4, precision="bf16", cuda=True)
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["bf16"]["enabled"]
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (4, 1, 1)
    assert total_steps(r) * t.batch_size * r.data.seq_len == 1_638_400_000  # the paper's 1.6B tokens


def test_blog_recipe_is_10k_steps_of_48k_tokens():
    r = load_recipe(CONFIGS / "llama2-7b-exp-linear.yaml")
    assert ConversionSpec.from_dict(r.conversion).method == "exp-linear"
    assert (r.train.max_steps, r.train.lr) == (10_000, 1e-4)
    assert r.train.batch_size * r.data.seq_len == 49_152
    cfg = deepspeed_config(r, world_size=4, precision="bf16", cuda=True)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["gradient_accumulation_steps"] == 3


def test_cpu_recipe_finds_the_bundled_books_and_holds_out_the_data_readmes_two():
    r = load_recipe("gemma3-270m-macchiato-cpu.yaml")  # a bundled name works too
    assert r.model.name == "gemma3-270m" and r.trainable.mode == "new"
    train = resolve_files(r.data.files, r.base_dir)
    held = resolve_files(r.eval.files, r.base_dir)
    assert train[0].parent.resolve() == BOOKS.resolve()
    # the split of the data README (and of `retrofit eval`'s pg-books-heldout): never train on these
    assert [f.name for f in held] == ["complete-angler.txt", "jack-sheppard.txt"]
    assert [f.name for f in train] == ["devils-dictionary.txt", "moby-dick.txt", "news-from-nowhere.txt",
                                       "pride-and-prejudice.txt"]
    assert not set(train) & set(held)


def test_data_files_override_and_env_form(tmp_path, monkeypatch):
    names = ["devils-dictionary.txt", "moby-dick.txt", "news-from-nowhere.txt", "pride-and-prejudice.txt"]
    for name in names:
        (tmp_path / name).write_text("hello")
    r = load_recipe(CONFIGS / "gemma3-270m-macchiato-cpu.yaml", [f"data.files={tmp_path}"])
    assert resolve_files(r.data.files, r.base_dir) == [tmp_path / n for n in names]
    monkeypatch.setenv("MY_BOOKS", str(tmp_path))
    r = load_recipe(CONFIGS / "gemma3-270m-macchiato-cpu.yaml", ["data.files=${MY_BOOKS:-nowhere}/moby-dick.txt"])
    assert resolve_files(r.data.files, r.base_dir) == [tmp_path / "moby-dick.txt"]


def test_every_bundled_recipe_reads_only_data_inside_the_package():
    from retrofit.catalog import recipe_names

    for name in recipe_names():
        r = load_recipe(name)
        if r.data.files is None:
            continue
        for f in resolve_files(r.data.files, r.base_dir) + (resolve_files(r.eval.files, r.base_dir) if r.eval.files else []):
            assert BOOKS.resolve() in f.resolve().parents, (name, f)


@pytest.mark.parametrize("name", ["smollm2-135m-macchiato-cpu.yaml", "smollm2-135m-macchiato-gpu.yaml",
                                  "smollm2-135m-macchiato-gpu-kl.yaml", "smollm2-135m-macchiato-gpu-16k.yaml"])
def test_smollm2_recipes_conversion_on_a_smollm2_shaped_llama(name):
    """The recipe's own conversion section on a LLaMA with SmolLM2's head layout (9 query / 3 KV heads):
    every layer converted, 16 latent states per query head, and with the latent path closed the model is
    the base run with the recipe's window and sinks, on a sequence longer than the window."""
    import torch

    from retrofit.surgery import convert
    from retrofit.surgery.probe import closed_latent_path
    from tests.surgery.tiny import band_reference, tiny_model

    spec = ConversionSpec.from_dict(load_recipe(CONFIGS / name).conversion)
    assert (spec.method, spec.layers, spec.window, spec.latents, spec.sinks) == ("macchiato", "all", 1024, 144, 4)
    model = tiny_model("llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=3)
    ids = torch.randint(3, 256, (1, spec.window + 96), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = 1  # BOS: the first sink
    with torch.no_grad():
        reference = band_reference(model, spec.window, sinks=spec.sinks)(ids).logits
        convert(model, spec)
        layers = [m for m in model.modules() if getattr(m, "is_retrofit_attention", False)]
        assert len(layers) == 3
        assert all(m.latent_k.out_features == 16 * model.config.num_attention_heads for m in layers)
        with closed_latent_path(model):
            closed = model(ids).logits
        opened = model(ids).logits
    torch.testing.assert_close(closed, reference, atol=2e-4, rtol=1e-4)
    assert (opened - closed).abs().max() > 1e-3  # the latent path, once open, is part of the output


def test_data_recall_is_off_by_default_and_checked_by_override():
    assert load_recipe(CONFIGS / "smollm2-135m-macchiato-cpu.yaml").data.recall.share == 0.0
    r = load_recipe(CONFIGS / "smollm2-135m-macchiato-cpu.yaml", ["data.recall.share=0.25", "data.recall.facts=2",
                                                                  "data.recall.min_distance=1500"])
    assert (r.data.recall.share, r.data.recall.facts, r.data.recall.min_distance, r.data.recall.seed) == (0.25, 2, 1500, 0)
    for bad, message in (("data.recall.share=2", r"data\.recall\.share must be in \[0, 1\]"),
                         ("data.recall.facts=0", r"data\.recall\.facts must be an integer in \[1, 64\]"),
                         ("data.recall.min_distance=-5", r"data\.recall\.min_distance must be >= 1"),
                         ("data.recall.sharee=0.5", r"unknown recipe key 'data\.recall\.sharee'")):
        with pytest.raises(SpecError, match=message):
            load_recipe(CONFIGS / "smollm2-135m-macchiato-cpu.yaml", [bad])


def test_recall_answer_weight_needs_recall_facts_and_an_attention_term():
    base = CONFIGS / "smollm2-135m-macchiato-cpu.yaml"  # objective attention
    r = load_recipe(base, ["data.recall.share=1", "data.recall.answer_weight=40"])
    assert r.data.recall.answer_weight == 40.0
    for extra, message in (([], r"data\.recall\.share is 0"),
                           (["data.recall.share=1", "train.objective=kl"], r"has none: set it to 1 here"),
                           (["data.recall.share=1", "train.objective=lm"], r"has none: set it to 1 here")):
        with pytest.raises(SpecError, match=message):
            load_recipe(base, ["data.recall.answer_weight=40", *extra])
    for bad in ("0.5", ".nan", "true"):
        with pytest.raises(SpecError, match=r"data\.recall\.answer_weight must be a (finite )?number"):
            load_recipe(base, ["data.recall.share=1", f"data.recall.answer_weight={bad}"])
    ok = load_recipe(base, ["data.recall.share=1", "train.objective=mix", "train.objective_weights={attention: 1, kl: 1}",
                            "data.recall.answer_weight=10"])
    assert ok.data.recall.answer_weight == 10.0


def test_overrides_are_typed_and_unknown_keys_name_the_valid_ones(tmp_path):
    r = load_recipe(CONFIGS / "gemma2-2b-macchiato.yaml", [
        "train.lr=1e-4", "train.max_steps=10", "trainable.mode=lora", "trainable.lora.target_modules=[q_proj]",
        "deepspeed.offload_optimizer=true", "conversion.init_swa_share=0.5", "train.max_tokens=1_000_000",
        "train.betas=0.9,0.99",
    ])
    assert r.train.betas == [0.9, 0.99]
    assert r.train.lr == 1e-4 and isinstance(r.train.lr, float)
    assert r.train.max_steps == 10 and r.trainable.lora.target_modules == ["q_proj"]
    assert r.deepspeed.offload_optimizer is True and r.conversion["init_swa_share"] == 0.5
    assert total_steps(r) == 10  # max_tokens allows 61 steps: the smaller bound wins
    assert total_steps(load_recipe(CONFIGS / "gemma2-2b-macchiato.yaml", ["train.max_tokens=163840"])) == 10
    cfg = deepspeed_config(r, world_size=1, precision="fp32", cuda=False)
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and cfg["gradient_accumulation_steps"] == 4

    with pytest.raises(SpecError, match=r"unknown recipe key 'train\.learning_rate' in section 'train'; valid keys: .*lr"):
        load_recipe(CONFIGS / "gemma2-2b-macchiato.yaml", ["train.learning_rate=1e-4"])
    with pytest.raises(SpecError, match=r"unknown recipe key 'optimiser' at the top level; valid keys: model, conversion"):
        recipe_from_dict({"model": {"name": "x"}, "optimiser": {}})
    with pytest.raises(SpecError, match="train.max_steps must be an integer"):
        load_recipe(CONFIGS / "gemma2-2b-macchiato.yaml", ["train.max_steps=lots"])
    with pytest.raises(SpecError, match="trainable.mode must be one of"):
        load_recipe(CONFIGS / "gemma2-2b-macchiato.yaml", ["trainable.mode=everything"])
    with pytest.raises(SpecError, match="section.key=value"):
        load_recipe(CONFIGS / "gemma2-2b-macchiato.yaml", ["lr"])
    with pytest.raises(SpecError, match="recipe file 'nope.yaml' not found"):
        load_recipe("nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"name": "m"}, "train": {"batch_size": 6, "micro_batch_size": 4}}))
    with pytest.raises(SpecError, match="multiple of train.micro_batch_size"):
        load_recipe(bad)


def test_deepspeed_config_rejects_what_the_recipe_owns(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}')
    r = recipe_from_dict({"model": {"name": "m"}, "deepspeed": {"config": "ds.json"}}, base_dir=tmp_path)
    with pytest.raises(SpecError, match="has an 'optimizer' section"):
        deepspeed_config(r, world_size=1, precision="fp32", cuda=False)
    r = recipe_from_dict({"model": {"name": "m"}, "train": {"batch_size": 4}}, base_dir=tmp_path)
    with pytest.raises(SpecError, match="multiple of micro_batch_size .* x data-parallel ranks \\(3\\)"):
        deepspeed_config(r, world_size=3, precision="fp32", cuda=False)
    r = recipe_from_dict({"model": {"name": "m"}, "deepspeed": {"offload_params": True}}, base_dir=tmp_path)
    with pytest.raises(SpecError, match="needs ZeRO stage 3"):
        deepspeed_config(r, world_size=1, precision="fp32", cuda=False)
    cfg = deepspeed_config(recipe_from_dict({"model": {"name": "m"}, "deepspeed": {"zero_stage": 3, "offload_params": True}}),
                           world_size=1, precision="fp32", cuda=False)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_warmup_then_cosine_to_the_floor():
    kw = dict(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lrs = [lr_at(s, **kw) for s in range(16)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and math.isclose(lrs[9], 0.55) and math.isclose(lrs[14], 0.1) and lrs[15] == lrs[14]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lr_at(100, lr=2.0, warmup_steps=0, total_steps=10, schedule="constant") == 2.0


def test_a_time_budget_advances_the_cosine_when_the_clock_is_further_along_than_the_steps():
    kw = dict(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert lr_at(2, **kw, time_fraction=0.9) == 0.75  # warmup stays by step
    assert math.isclose(lr_at(4, **kw, time_fraction=0.5), 0.55)  # half the time spent: half-way down
    assert math.isclose(lr_at(4, **kw, time_fraction=1.0), 0.1)
    assert lr_at(12, **kw, time_fraction=0.1) == lr_at(12, **kw)  # the steps are further along: they decide


@pytest.mark.parametrize("value", [0, -5, "1h", True, float("inf")])
def test_max_time_must_be_positive_seconds(value):
    with pytest.raises(SpecError, match="train.max_time"):
        recipe_from_dict({"model": {"name": "m"}, "train": {"max_time": value}})


def test_layer_weights_are_checked_with_the_recipe():
    cfg = CONFIGS / "smollm2-135m-macchiato-cpu.yaml"
    r = load_recipe(cfg, ["train.layer_weights={13-29: 4, 0: 0.5}"])
    assert r.train.layer_weights == {"13-29": 4, 0: 0.5}
    for bad, message in ((["train.layer_weights={all: 2}"], "by index"),
                         (["train.layer_weights={3: -1}"], ">= 0"),
                         (["train.layer_weights={3: 2}", "train.objective=kl"], "has neither")):
        with pytest.raises(SpecError, match=message):
            load_recipe(cfg, bad)


def test_a_mistyped_recipe_path_is_an_error_not_the_bundled_recipe_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: bundled names resolve through the package
    for name in ("smollm2-135m-macchiato-cpu", "smollm2-135m-macchiato-cpu.yaml", "configs/smollm2-135m-macchiato-cpu.yaml"):
        assert load_recipe(name).model.name == "smollm2-135m", name
    for typo in ("typo/smollm2-135m-macchiato-cpu.yaml", str(tmp_path / "smollm2-135m-macchiato-cpu.yaml"),
                 "configs/deepspeed/smollm2-135m-macchiato-cpu.yaml"):
        with pytest.raises(SpecError, match="not found .*retrofit train smollm2-135m-macchiato-cpu"):
            load_recipe(typo)
