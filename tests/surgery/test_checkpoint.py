"""Checkpoints: bit-exact round trips (full and delta), strict checks, atomic writes, load_any."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import retrofit
from retrofit.errors import CheckpointError
from retrofit.surgery import (
    ConversionSpec, convert, load, load_any, load_delta, new_parameter_names, save, save_delta,
)
from tests.surgery.tiny import tiny_model, tiny_tokenizer


def _trained(model):
    """Give the new weights non-initial values, as after training."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in new_parameter_names(model):
            params[n].normal_()
    return model


def _assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    ids = torch.randint(3, 256, (2, 33))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.fixture
def base_dir(tmp_path):
    model = tiny_model("gemma3")
    model.save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    return tmp_path / "base"


@pytest.mark.parametrize("family,spec", [
    ("gemma3", ConversionSpec(window=8, latents=8, conv_size=3)),
    ("llama", ConversionSpec(window=8, latents=8, layers=[1], dtype="bfloat16")),
    ("gemma2", ConversionSpec(method="exp-linear")),
])
def test_round_trip_is_bit_exact(tmp_path, family, spec):
    model = _trained(convert(tiny_model(family), spec, base_model="tiny"))
    out = save(model, tmp_path / "ckpt", tokenizer=tiny_tokenizer())
    files = sorted(os.listdir(out))
    assert "model.safetensors" in files and not [f for f in files if f.endswith((".bin", ".pt"))]
    assert json.loads((out / "config.json").read_text())["retrofit"] == model.config.retrofit
    loaded = retrofit.load(out)
    _assert_same(model, loaded)
    assert loaded.config.retrofit == model.config.retrofit
    assert sorted(n for n, p in loaded.named_parameters() if p.requires_grad) == sorted(new_parameter_names(loaded))
    again, tok = load_any(out)
    _assert_same(model, again)
    assert tok is not None and tok("Mr. Bennet")["input_ids"]


def test_delta_round_trip_reattaches_to_its_base(base_dir, tmp_path):
    model, _ = load_any(base_dir)
    _trained(convert(model, ConversionSpec(window=8, latents=8)))
    out = save_delta(model, tmp_path / "delta")
    assert sorted(os.listdir(out)) == [".retrofit-files.json", "delta.safetensors", "retrofit_delta.json"]
    assert sorted(load_file(out / "delta.safetensors")) == sorted(new_parameter_names(model))
    again, tok = load_delta(out)  # base from the record
    _assert_same(model, again)
    assert tok is not None
    _assert_same(model, load(out))  # retrofit.load accepts a delta folder too
    _assert_same(model, load_any(out)[0])


def test_delta_needs_a_base(tmp_path):
    model = convert(tiny_model("llama"), ConversionSpec(window=8, latents=8))
    with pytest.raises(CheckpointError, match="must name its base"):
        save_delta(model, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_delta_with_a_pre_release_fingerprint_is_refused_with_what_to_do(base_dir, tmp_path):
    model, _ = load_any(base_dir)
    out = save_delta(convert(model, ConversionSpec(window=8, latents=8)), tmp_path / "delta")
    manifest = json.loads((out / "retrofit_delta.json").read_text())
    manifest["base_fingerprint"]["format"] = "retrofit-fingerprint/1"  # what pre-release versions wrote
    (out / "retrofit_delta.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format 'retrofit-fingerprint/1'.*make the delta again"):
        load_delta(out)


def _saved(tmp_path, spec=ConversionSpec(window=8, latents=8)):
    model = _trained(convert(tiny_model("llama"), spec, base_model="tiny"))
    return model, save(model, tmp_path / "ckpt")


def test_section_and_weights_must_agree(tmp_path):
    _, out = _saved(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["retrofit"]["latents"] = 16  # weights hold 8 latents
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load(out)
    cfg["retrofit"]["latents"] = 8
    cfg["retrofit"]["conv_size"] = 3  # the files have no conv weights
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="files lack: .*conv.weight"):
        load(out)
    cfg["retrofit"]["conv_size"] = 0
    from retrofit.layers import ExpLinearConfig, MacchiatoConfig

    own = set(ExpLinearConfig.field_names())  # an exp-linear record: the files hold latent weights nobody explains
    cfg["retrofit"] = {k: v for k, v in cfg["retrofit"].items() if k in own or k not in MacchiatoConfig.field_names()}
    cfg["retrofit"]["method"] = "exp-linear"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not explain: .*latent_"):
        load(out)


def test_missing_tensor_and_missing_section(tmp_path):
    _, out = _saved(tmp_path)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.self_attn.latent_k.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="latent_k.weight"):
        load(out)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["retrofit"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a converted checkpoint"):
        load(out)
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)


def test_saves_are_atomic_and_never_clobber(tmp_path):
    model, out = _saved(tmp_path)
    with pytest.raises(CheckpointError, match="already exists"):
        save(model, out)

    class Broken:
        def save_pretrained(self, path):
            (path / "half-written").write_text("x")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save(model, tmp_path / "new", tokenizer=Broken())
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no partial folder, no temp leftovers
    with pytest.raises(RuntimeError):
        save(model, out, tokenizer=Broken(), overwrite=True)
    _assert_same(model, load(out))  # the old checkpoint survived the failed overwrite
    save(model, out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_load_any_base_folder(base_dir):
    model, tok = load_any(base_dir)
    assert not hasattr(model.config, "retrofit") and tok is not None
    assert model.config._name_or_path == str(base_dir)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_any(base_dir.parent / "nope")


def test_capped_sinks_survive_save_and_load(tmp_path):
    """transformers builds a loaded model on the meta device: the sinks' RoPE frequencies must
    still be real numbers afterwards, and the capped model must score as before saving."""
    spec = ConversionSpec(window=8, latents=8, sinks=2, sink_distance=12)
    model, out = _saved(tmp_path, spec)
    loaded = load(out)
    layer = next(m for m in loaded.modules() if getattr(m, "sink_distance", 0))
    assert layer.sink_distance == 12 and layer.sink_inv_freq.device.type == "cpu"
    ids = torch.randint(3, 200, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
