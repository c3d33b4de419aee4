"""``retrofit fit``: each layer sees the base's own inputs (the capped base past its RoPE cap), the
maps' fit lowers the layer's KL beyond the window and touches nothing else, the scale is the least
squares solution, and the verb writes a delta every other verb reads (and refuses what it must)."""
from __future__ import annotations

import copy
import re
import json

import pytest
import torch
import yaml

from retrofit import surgery
from retrofit.cli.main import main
from retrofit.surgery import cap_rope, convert
from retrofit.surgery.distill import converted_modules
from retrofit.train.fit import capture_layer_inputs, fit_maps, fit_scale, scale_problem
from tests.train import tiny

pytestmark = pytest.mark.usefixtures("one_thread")
HEDGEHOG = {"method": "hedgehog", "window": 8, "sinks": 2, "features": 8, "memory_distance": 8}


def _base_inputs(model, ids) -> dict[int, torch.Tensor]:
    """Each layer's attention input in an unconverted model (a forward pre-hook on the family's module)."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.__setitem__(i, kw["hidden_states"]), with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids[None])
    for h in hooks:
        h.remove()
    return seen


def test_layers_see_the_base_models_inputs_capped_past_the_rope_cap():
    base = tiny.base_model()
    ids = torch.randint(3, tiny.VOCAB, (40,))
    model = convert(copy.deepcopy(base), surgery.ConversionSpec(**HEDGEHOG, rope_cap=20))
    got = capture_layer_inputs(model, ids)
    plain = _base_inputs(base, ids)
    capped_base = copy.deepcopy(base)
    cap_rope(capped_base, 20)
    capped = _base_inputs(capped_base, ids)
    assert sorted(got) == [0, 1]
    torch.testing.assert_close(got[0][0][0], capped[0][0])  # the embeddings
    torch.testing.assert_close(got[1][0][0], capped[1][0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[1][0][0], plain[1][0], atol=1e-4)  # 40 tokens > the cap: the capped base
    assert all("original_attention" not in m.__dict__ for m in converted_modules(model))  # the recording is undone


def _fitting_setup(pretrained_base, T=96, n=2):
    model = surgery.convert(surgery.load_any(str(pretrained_base), dtype=torch.float32)[0], surgery.ConversionSpec(**HEDGEHOG))
    tok = tiny.tokenizer()
    ids = torch.tensor(tok(tiny.book_text("pride-and-prejudice.txt", chars=20_000), verbose=False)["input_ids"])
    inputs = [capture_layer_inputs(model, ids[i * T:(i + 1) * T]) for i in range(n)]
    return model, inputs


def test_fit_maps_lowers_the_layers_kl_and_trains_only_its_maps(pretrained_base):
    model, captured = _fitting_setup(pretrained_base)
    attn = converted_modules(model)[1]
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = fit_maps(attn, [c[1] for c in captured], steps=40, queries=32, lr=3e-2, generator=torch.Generator().manual_seed(0))
    assert 0 < out["kl_after"] < 0.8 * out["kl_before"], out
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"model.layers.1.self_attn.feature_query.weight", "model.layers.1.self_attn.feature_key.weight"}


def test_fit_scale_is_the_least_squares_solution(pretrained_base):
    model, captured = _fitting_setup(pretrained_base)
    attn = converted_modules(model)[0]
    inputs = [c[0] for c in captured]
    out = fit_scale(attn, inputs, queries=48, generator=torch.Generator().manual_seed(1))
    x, y = scale_problem(attn, inputs, queries=48, generator=torch.Generator().manual_seed(1))
    s = attn.memory_scale
    coef = torch.cat([s.weight, s.bias[:, None], s.count_weight[:, None]], dim=1).double()
    residual = (x @ coef[..., None])[..., 0] - y
    normal = (x.transpose(1, 2) @ residual[..., None])[..., 0]  # X^T (X c - y) = 0 at the optimum
    assert normal.abs().max() < 1e-5 * (x.abs().max() ** 2) * x.shape[1], normal.abs().max()
    assert out["rms_after"] < out["rms_before"] and out["rows"] == x.shape[1] >= x.shape[2]
    torch.testing.assert_close(residual.pow(2).mean(-1).sqrt().mean().item(), out["rms_after"])


def _recipe(tmp_path, books, model_dir, **fit):
    r = tiny.recipe_dict(model_dir, books, tmp_path / "run", conversion=HEDGEHOG)
    r["fit"] = {"maps": {"seq_len": 64, "sequences": 2, "steps": 15, "queries": 16},
                "scale": {"seq_len": 128, "sequences": 2, "queries": 32}, **fit}
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def test_fit_cli_writes_a_delta_every_verb_reads_and_refits_the_scale_alone(tmp_path, books, pretrained_base, capsys):
    recipe = _recipe(tmp_path, books, pretrained_base)
    out = tmp_path / "fitted"
    assert main(["fit", str(recipe), "--out", str(out)]) == 0
    assert "| layer |" in capsys.readouterr().out
    report = json.loads((out / "fit.json").read_text())
    assert [r["layer"] for r in report["maps"]["layers"]] == [0, 1] == [r["layer"] for r in report["scale"]["layers"]]
    assert report["maps"]["tokens"] == 2 * 64 and report["scale"]["seq_len"] == 128
    model, _ = surgery.load_any(str(out), dtype=torch.float32)
    first = {n: p.detach().clone() for n, p in model.named_parameters() if "feature_" in n or "memory_scale" in n}
    assert all(torch.isfinite(p).all() for p in first.values())
    assert not torch.allclose(first["model.layers.0.self_attn.memory_scale.bias"], torch.tensor(2.0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(3, tiny.VOCAB, (1, 50))).logits).all()

    # the scale refitted on longer sequences from the fitted model: its maps kept, its base the original
    again = tmp_path / "refit"
    assert main(["fit", str(recipe), "--out", str(again), f"model.name={out}", "fit.maps.steps=0",
                 "fit.scale.seq_len=256"]) == 0
    record = json.loads((again / "retrofit_delta.json").read_text())["retrofit"]
    assert record["base_model"] == str(pretrained_base.resolve())
    refit, _ = surgery.load_any(str(again), dtype=torch.float32)
    params = dict(refit.named_parameters())
    for name, value in first.items():
        assert torch.equal(params[name], value) == ("feature_" in name), name
    assert json.loads((again / "fit.json").read_text())["maps"] == {}


def test_fit_cli_refusals(tmp_path, books, pretrained_base, converted_dir, capsys):
    recipe = _recipe(tmp_path, books, pretrained_base)
    out = tmp_path / "fitted"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["fit", str(recipe), "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"
    assert main(["fit", str(recipe), "--out", str(out), "--overwrite"]) == 1
    assert "not a checkpoint folder" in capsys.readouterr().err and (out / "notes.txt").is_file()
    assert main(["fit", str(recipe), f"model.name={converted_dir}", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "method hedgehog" in err and "macchiato" in err
    assert not (tmp_path / "m").exists()
    assert main(["fit", str(recipe), "fit.maps.queries=0", "--out", str(tmp_path / "m")]) == 1
    assert "fit.maps" in capsys.readouterr().err
    assert main(["fit", str(recipe), "fit.scale.sequences=400", "--out", str(tmp_path / "m")]) == 1
    assert "sequences of 128 tokens" in capsys.readouterr().err and not (tmp_path / "m").exists()
    assert main(["train", str(recipe)]) == 1  # a fit recipe is not a training recipe
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "retrofit fit" in err
    assert main(["fit", str(recipe), "--print-recipe", "fit.maps.seq_len=96"]) == 0  # overrides after a flag too
    assert yaml.safe_load(capsys.readouterr().out)["fit"]["maps"]["seq_len"] == 96
    with pytest.raises(SystemExit):
        main(["fit", str(recipe), "--print-recipe", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_fitting_is_a_capability_the_method_declares_not_its_name(tmp_path, books, monkeypatch, capsys):
    """``retrofit fit`` takes the methods whose config declares ``fit`` (Hedgehog's, or a method
    registered under another name), and refuses another with one error line naming those it takes:
    a recipe converting with it before anything loads, a converted model when it is loaded."""
    from retrofit.errors import SpecError
    from retrofit.layers import method as registry
    from retrofit.layers.hedgehog import HedgehogConfig, build_hedgehog
    from retrofit.train.fit import FIT, check_fittable_recipe, fittable_layers, fittable_methods
    from retrofit.train.recipe import load_recipe

    assert FIT in HedgehogConfig.capabilities and fittable_methods() == ["hedgehog"]
    base = tiny.save_base(tmp_path / "base")
    capsys.readouterr()
    other = tiny.recipe_dict(base, books, tmp_path / "run", conversion={"method": "macchiato", "window": 8})
    other["fit"] = {"maps": {"seq_len": 64, "sequences": 1, "steps": 1}, "scale": {"seq_len": 64, "sequences": 1}}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    out = tmp_path / "m"
    assert main(["fit", str(tmp_path / "other.yaml"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "\n" not in err.strip(), err
    assert "declares the 'fit' capability (method hedgehog)" in err
    assert "conversion section converts with method macchiato, which does not" in err
    assert not out.exists()

    # a method of another name whose config declares fit is fitted; Hedgehog without the declaration is not
    class _ToyConfig(HedgehogConfig):  # Hedgehog's fields under another name, declaring fit itself
        method = "fit-capability-toy"
        capabilities = frozenset({FIT})

    def build(original, patch, spec, layer_idx, generator):
        layer = build_hedgehog(original, patch, spec, layer_idx, generator)
        layer.method = "fit-capability-toy"
        return layer

    registry.register_method("fit-capability-toy", build, config=_ToyConfig, replace=True)
    try:
        assert fittable_methods() == ["fit-capability-toy", "hedgehog"]
        toy = convert(tiny.base_model(), surgery.ConversionSpec(**{**HEDGEHOG, "method": "fit-capability-toy"}))
        assert len(fittable_layers(toy)) == 2
        monkeypatch.setattr(HedgehogConfig, "capabilities", frozenset({"attention_weights"}))
        assert fittable_methods() == ["fit-capability-toy"]
        with pytest.raises(SpecError, match="the model's layers are of method hedgehog, which does not"):
            fittable_layers(convert(tiny.base_model(), surgery.ConversionSpec(**HEDGEHOG)))
        with pytest.raises(SpecError, match=r"\(method fit-capability-toy\); the recipe's conversion section converts with "
                                            r"method hedgehog, which does not"):
            check_fittable_recipe(load_recipe(str(_recipe(tmp_path, books, base))))
    finally:
        registry._METHODS.pop("fit-capability-toy", None)


def test_demo_fits_a_fit_recipe_instead_of_training_it(tmp_path, books, pretrained_base):
    from retrofit.demo import DemoSettings, run_demo
    from retrofit.errors import RetrofitError

    recipe = _recipe(tmp_path, books, pretrained_base)
    r = yaml.safe_load(recipe.read_text())
    r["data"]["holdout_last"] = 1  # the demo scores the held-out book
    recipe.write_text(yaml.safe_dump(r))
    settings = DemoSettings(recipe=str(recipe), ppl_lengths=[64, 128], passkey_lengths=[256], passkey_depths=[0.0],
                            passkey_trials=1, prompt_tokens=24, new_tokens=4, eval_dtype="float32")
    out = tmp_path / "demo"
    with pytest.raises(RetrofitError, match="fit.maps.steps"):  # a training flag on a fit recipe: refused, nothing written
        run_demo(out, DemoSettings(**{**settings.__dict__, "training_flags": ["--steps"]}), echo=lambda _m: None)
    assert not out.exists()
    lines = []
    report = run_demo(out, settings, echo=lines.append).read_text()
    assert "## Fitting" in report and "## Training" not in report and "| layer |" in report
    assert any("fit the new weights layer by layer (maps: 2 x 64 tokens, 15 steps" in m for m in lines)
    results = json.loads((out / "results.json").read_text())
    assert results["training"] is None
    assert [r["layer"] for r in results["fit"]["maps"]["layers"]] == [0, 1]
    assert all(r["kl_after"] < r["kl_before"] for r in results["fit"]["maps"]["layers"])
    assert "model:closed" in results["perplexity"]["models"]  # the read closed, scored beside
    fitted = dict(surgery.load_any(str(out / "fit" / "final"), dtype=torch.float32)[0].named_parameters())
    converted = dict(surgery.load_any(str(out / "converted"), dtype=torch.float32)[0].named_parameters())
    name = "model.layers.1.self_attn.feature_key.weight"
    assert not torch.equal(fitted[name], converted[name])  # the scored model is the fitted one
    assert (out / "fit" / "final" / "fit.json").is_file()


def test_fit_cli_shows_progress_on_stderr_unless_quiet(tmp_path, books, pretrained_base, capsys):
    recipe = _recipe(tmp_path, books, pretrained_base)
    assert main(["fit", str(recipe), "--out", str(tmp_path / "shown"), "logging.progress=true"]) == 0
    captured = capsys.readouterr()
    err = captured.err
    for part in ("fit maps: capture", "fit maps", "fit scale: capture", "fit scale"):
        assert part in err, part
    assert "layer 1/2" in err and "layer 2/2" in err
    assert re.search(r"fit maps: +\d+%.*15/30 \[\d\d:\d\d<.*step.*layer 1/2 loss \d+\.\d{3}", err), err
    assert re.search(r"fit maps: .*30/30 \[\d\d:\d\d<.*layer 2/2 loss \d+\.\d{3}", err)
    assert "%|" not in captured.out and "fit maps: layer 1 (2/2)" in captured.out  # the bar on stderr, the log lines on stdout

    assert main(["fit", str(recipe), "--out", str(tmp_path / "quiet"), "-q", "logging.progress=true"]) == 0
    captured = capsys.readouterr()
    assert "fit maps" not in captured.err and "layer" not in captured.err and captured.out == ""
