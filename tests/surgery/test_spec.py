"""ConversionSpec validation, YAML recipes, the method registry and convert()'s error paths."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from retrofit.errors import SpecError, UnsupportedModelError
from retrofit.layers import RetrofitAttention, available_methods, register_method
from retrofit.surgery import ConversionSpec, convert, converted_layers, new_parameter_names
from retrofit.surgery.spec import DEFAULT_WINDOW, parse_layers
from tests.surgery.tiny import tiny_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="nope"), "unknown method 'nope'.*macchiato"),
        (dict(window=0), "window must be >= 1"),
        (dict(latents=-4), "latents must be >= 0"),
        (dict(init_swa_share=0.0), r"init_swa_share must be in \(0, 1\]"),
        (dict(init_swa_share=1.5), r"init_swa_share must be in \(0, 1\]"),
        (dict(conv_size=-1), "conv_size"),
        (dict(window=12.5), "window must be an integer"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(layers=[0, -1]), "indices must be >= 0"),
        (dict(layers="x"), "cannot parse"),
        (dict(options={"rank": 4}), "has no option"),
    ],
)
def test_bad_specs_raise_one_clear_error(kwargs, match):
    with pytest.raises(SpecError, match=match):
        ConversionSpec(**kwargs)


def test_layer_selection_and_dtype_aliases():
    assert parse_layers("0-2,5") == [0, 1, 2, 5]
    assert parse_layers("all") == "all" and parse_layers([3, 1, 3]) == [1, 3]
    assert ConversionSpec(dtype="bf16").dtype == "bfloat16"


def test_sizes_that_do_not_fit_the_model():
    model = tiny_model("llama")  # 4 query heads, 2 layers
    fit = r"does not split over the model's 4 query heads; use a multiple of 4 \(e.g. 8 or 12\)"
    with pytest.raises(SpecError, match=fit):
        convert(model, ConversionSpec(latents=10))
    with pytest.raises(SpecError, match=r"use a multiple of 4 \(e.g. 4\)$"):  # below the heads: one suggestion
        convert(model, ConversionSpec(latents=3))
    with pytest.raises(SpecError, match="layers \\[5\\] do not exist"):
        convert(model, ConversionSpec(layers=[0, 5]))
    assert converted_layers(model) == []  # nothing half-converted
    with pytest.raises(SpecError, match="latents .*does not apply to method 'exp-linear'"):
        ConversionSpec(method="exp-linear", latents=10)  # a key exp-linear does not have is an error now
    convert(model, ConversionSpec(method="exp-linear"))  # the head count only matters to latents


def test_converting_twice_is_refused():
    model = tiny_model("gemma")
    convert(model, ConversionSpec(window=4, latents=4))
    with pytest.raises(SpecError, match="already converted"):
        convert(model)


def test_unsupported_model():
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="Supported families"):
        convert(model)


def test_yaml_recipes(tmp_path):
    spec = ConversionSpec.from_yaml(CONFIGS / "convert-macchiato.yaml")
    # the shipped recipe spells out the defaults (the window as resolved for layers: all)
    assert spec == dataclasses.replace(ConversionSpec(), window=DEFAULT_WINDOW)
    assert ConversionSpec.from_yaml(CONFIGS / "convert-exp-linear.yaml").method == "exp-linear"
    keep = ConversionSpec.from_yaml(CONFIGS / "convert-gemma3-270m-keep-retrieval.yaml")
    assert (keep.layers, keep.window, keep.sinks, keep.rope_cap) == ([17], 2048, 4, 32767)
    nested = tmp_path / "recipe.yaml"
    nested.write_text("convert:\n  method: macchiato\n  window: 64\n  layers: '0-1'\ntrain: {lr: 1.0}\n")
    spec = ConversionSpec.from_yaml(nested, window=32)
    assert spec.window == 32 and spec.layers == [0, 1]  # overrides win over the file
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: macchiato\nwindw: 64\n")
    with pytest.raises(SpecError, match="unknown conversion key.*windw"):
        ConversionSpec.from_yaml(bad)


def test_record_in_config():
    model = tiny_model("qwen2")
    convert(model, ConversionSpec(window=16, latents=8, layers=[1]), base_model="tiny/qwen2")
    rec = model.config.retrofit
    assert rec["method"] == "macchiato" and rec["window"] == 16 and rec["latents"] == 8
    assert rec["converted_layers"] == [1] and rec["base_model"] == "tiny/qwen2" and rec["toolkit_version"]
    assert model.config.to_dict()["retrofit"] == rec  # serialised by save_pretrained


class _ScaledIdentity(RetrofitAttention):
    """A toy method registered from outside: attention output = o_proj(gain * v) (no mixing)."""

    method = "toy"
    new_module_names = ("gain",)

    def __init__(self, original, patch, gain):
        super().__init__(original, patch)
        self.gain = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(self.gain.weight, gain)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kw):
        q, k, v = self.patch.project_qkv(self, hidden_states, position_embeddings)
        v = v.repeat_interleave(self.num_heads // self.num_kv_heads, 1) * self.gain.weight[0, 0]
        return self.patch.project_out(self, v), None


def test_register_a_method_without_editing_surgery():
    register_method("toy-test", lambda orig, patch, spec, idx, gen: _ScaledIdentity(orig, patch, spec.config.gain),
                    options={"gain": 1.0}, replace=True)
    assert "toy-test" in available_methods()
    model = tiny_model("llama")
    convert(model, ConversionSpec(method="toy-test", options={"gain": 2.0}))
    assert all(isinstance(layer.self_attn, _ScaledIdentity) for layer in model.model.layers)
    assert new_parameter_names(model) == ["model.layers.0.self_attn.gain.weight", "model.layers.1.self_attn.gain.weight"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 256, (1, 9))).logits).all()
    with pytest.raises(SpecError, match="has no option"):
        ConversionSpec(method="toy-test", options={"rank": 2})


def test_layers_global_converts_the_full_attention_layers_with_the_native_window():
    model = tiny_model("gemma3", num_hidden_layers=4,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    convert(model, ConversionSpec(layers="global", latents=8))
    assert converted_layers(model) == [1, 3]
    assert model.config.retrofit["window"] == 24 and model.config.retrofit["layers"] == "global"
    other = convert(tiny_model("gemma3"), ConversionSpec(layers="global", window=8, latents=8))
    assert other.config.retrofit["window"] == 8  # an explicit window wins
    assert ConversionSpec().resolved(model.config).window == DEFAULT_WINDOW  # layers: all -> 128


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_layers_global_needs_a_hybrid_model(family):
    with pytest.raises(SpecError, match="layers: global"):
        convert(tiny_model(family), ConversionSpec(layers="global", latents=8))
