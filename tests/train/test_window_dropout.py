"""Scheduled sliding-window dropout (train.window_dropout): what a dropped layer computes, the
schedule, the draws, and the recipe's wiring and errors."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from retrofit.errors import SpecError
from retrofit.layers import MacchiatoAttention, MacchiatoConfig
from retrofit.layers.method import register_method
from retrofit.surgery.distill import converted_modules
from retrofit.surgery import ConversionSpec, convert
from retrofit.train import train
from retrofit.train.metrics import read_metrics
from retrofit.train.recipe import recipe_from_dict
from retrofit.train.window_dropout import dropout_layers, set_window_dropout, window_dropout_at
from tests.surgery.tiny import tiny_model
from tests.train import tiny

T = 24


def _layer_outputs(model, ids):
    """Each converted layer's output (before o_proj is fine: any function of the layer's mix) by layer."""
    outs = {}
    hooks = [m.register_forward_hook(lambda mod, _i, o, idx=i: outs.__setitem__(idx, o[0].detach().clone()))
             for i, m in enumerate(dropout_layers(model))]
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return outs


def _perturb_keys(model):
    """A copy of the model with every converted layer's k_proj changed: only the window branch reads keys."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        for m in dropout_layers(other):
            m.k_proj.weight.mul_(-1.5)
    return other


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_dropped_window_leaves_the_latent_states_alone(family):
    layers = "global" if family == "gemma3" else "all"
    model = convert(tiny_model(family), ConversionSpec(window=6, latents=8, init_swa_share=0.5, sinks=2, layers=layers))
    model.train()
    ids = torch.randint(3, 256, (4, T), generator=torch.Generator().manual_seed(0))
    other = _perturb_keys(model)
    for m in (model, other):
        set_window_dropout(dropout_layers(m), 1.0, seed=0, step=0)
    dropped, dropped_other = _layer_outputs(model, ids), _layer_outputs(other, ids)
    assert dropped and all(torch.allclose(dropped[i], dropped_other[i], atol=1e-6) for i in dropped)  # keys unused
    for m in (model, other):
        set_window_dropout(dropout_layers(m), 0.0)
    kept, kept_other = _layer_outputs(model, ids), _layer_outputs(other, ids)
    assert all((kept[i] - kept_other[i]).abs().max() > 1e-3 for i in kept)  # the window branch reads them
    assert all((kept[i] - dropped[i]).abs().max() > 1e-3 for i in kept)
    # eval mode never drops, whatever the probability
    model.eval()
    set_window_dropout(dropout_layers(model), 1.0, seed=0, step=0)
    evald = _layer_outputs(model, ids)
    assert all(torch.allclose(evald[i], kept[i], atol=1e-6) for i in kept)


def test_draws_are_per_sequence_and_repeat_for_the_same_seed_and_step():
    model = convert(tiny_model("llama"), ConversionSpec(window=6, latents=8, init_swa_share=0.5)).train()
    ids = torch.randint(3, 256, (16, T), generator=torch.Generator().manual_seed(1))
    layers = dropout_layers(model)
    set_window_dropout(layers, 0.0)
    kept = _layer_outputs(model, ids)
    set_window_dropout(layers, 1.0, seed=0, step=0)
    gone = _layer_outputs(model, ids)
    set_window_dropout(layers, 0.5, seed=3, step=7)
    half = _layer_outputs(model, ids)
    set_window_dropout(layers, 0.5, seed=3, step=7)
    again = _layer_outputs(model, ids)
    set_window_dropout(layers, 0.5, seed=3, step=8)
    next_step = _layer_outputs(model, ids)
    # the first converted layer sees the same input in every run (later ones see what it drew)
    rows_kept = torch.tensor([torch.allclose(half[0][b], kept[0][b], atol=1e-6) for b in range(16)])
    rows_gone = torch.tensor([torch.allclose(half[0][b], gone[0][b], atol=1e-6) for b in range(16)])
    assert bool((rows_kept ^ rows_gone).all())  # each sequence: all of its tokens dropped, or none
    assert 0 < int(rows_gone.sum()) < 16
    assert all(torch.equal(half[i], again[i]) for i in kept)
    assert any(not torch.equal(half[i], next_step[i]) for i in kept)


def test_schedule_decays_linearly_to_zero_at_until():
    assert [window_dropout_at(s, 10, 0.8) for s in (0, 5, 10)] == pytest.approx([0.8, 0.4, 0.0])
    assert [window_dropout_at(s, 10, 0.5, until=0.4) for s in (0, 2, 4, 9)] == pytest.approx([0.5, 0.25, 0.0, 0.0])
    assert window_dropout_at(3, 10, 0.0) == 0.0
    assert window_dropout_at(1, 10, 0.8, time_fraction=0.5) == pytest.approx(0.4)  # train.max_time half spent


@pytest.mark.parametrize("train_keys,conversion,message", [
    ({"window_dropout": 1.5}, {}, r"train.window_dropout must be in \[0, 1\]"),
    ({"window_dropout": 0.5, "window_dropout_until": 0.0}, {}, r"window_dropout_until must be in \(0, 1\]"),
    ({"window_dropout": 0.5}, {"method": "exp_linear"}, "conversion.method is 'exp_linear', which has none"),
    ({"window_dropout": 0.5}, {"latents": 0}, "conversion.latents is 0"),
])
def test_recipe_errors(tmp_path, train_keys, conversion, message):
    d = tiny.recipe_dict(tmp_path / "m", tmp_path / "d", tmp_path / "out", train=train_keys, conversion=conversion)
    with pytest.raises(SpecError, match=message):
        recipe_from_dict(d).validate()


def test_a_model_without_latent_states_is_refused_before_training(books, tmp_path):
    model = tiny.save_converted(tmp_path / "no-latents", latents=0)
    recipe = recipe_from_dict(tiny.recipe_dict(model, books, tmp_path / "out", train={"window_dropout": 0.5}))
    with pytest.raises(SpecError, match="has no converted layer with a window branch to drop"):
        train(recipe)
    assert not (tmp_path / "out" / "final").exists()


def test_training_logs_the_schedule_and_dropping_changes_the_updates(converted_dir, books, tmp_path):
    common = dict(train={"max_steps": 4, "gradient_checkpointing": False}, checkpoint={"save_every": 4})
    plain = train(recipe_from_dict(tiny.recipe_dict(converted_dir, books, tmp_path / "plain", **common)))
    common["train"] = {**common["train"], "window_dropout": 1.0, "window_dropout_until": 0.5}
    dropped = train(recipe_from_dict(tiny.recipe_dict(converted_dir, books, tmp_path / "dropped", **common)))
    rows = read_metrics(tmp_path / "dropped" / "metrics.jsonl", "train")
    assert [r["window_dropout"] for r in rows] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert "window_dropout" not in read_metrics(tmp_path / "plain" / "metrics.jsonl", "train")[0]
    assert dropped.history[0]["loss"] != pytest.approx(plain.history[0]["loss"], rel=1e-6)  # step 1 had no window
    assert dropped.history[2]["loss"] != pytest.approx(plain.history[2]["loss"], rel=1e-6)  # other weights by then


# ---- window dropout is a capability a method declares, not a method name
@dataclass
class _AliasConfig(MacchiatoConfig):
    method = "macchiato-alias-test"  # declares window_dropout (inherited) under another name


@dataclass
class _NoDropConfig(MacchiatoConfig):
    method = "macchiato-nodrop-test"
    capabilities = frozenset()


class _AliasAttention(MacchiatoAttention):
    method = "macchiato-alias-test"


class _NoDropAttention(MacchiatoAttention):
    method = "macchiato-nodrop-test"


def _builder(cls):
    def build(original, patch, spec, layer_idx, generator):
        return cls(original, patch, window=spec.config.window, latents=spec.config.latents, generator=generator)
    return build


register_method("macchiato-alias-test", _builder(_AliasAttention), config=_AliasConfig, replace=True)
register_method("macchiato-nodrop-test", _builder(_NoDropAttention), config=_NoDropConfig, replace=True)


def test_the_declared_capability_decides_which_layers_drop_their_window(tmp_path):
    keys = dict(window=8, latents=8)
    alias = convert(tiny_model("llama"), ConversionSpec(method="macchiato-alias-test", **keys))
    assert dropout_layers(alias) == converted_modules(alias) and len(dropout_layers(alias)) == 2
    nodrop = convert(tiny_model("llama"), ConversionSpec(method="macchiato-nodrop-test", **keys))
    assert dropout_layers(nodrop) == []

    def recipe(conversion):
        return recipe_from_dict(tiny.recipe_dict(tmp_path / "m", tmp_path / "d", tmp_path / "out",
                                                 train={"window_dropout": 0.5}, conversion=conversion))

    recipe({"method": "macchiato-alias-test", **keys}).validate()
    with pytest.raises(SpecError, match="conversion.method is 'macchiato-nodrop-test', which has none"):
        recipe({"method": "macchiato-nodrop-test", **keys}).validate()
    with pytest.raises(SpecError, match="conversion.latents is 0"):
        recipe({"method": "macchiato-alias-test", "window": 8, "latents": 0}).validate()
