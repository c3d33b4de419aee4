"""`retrofit convert` on tiny local models: success paths and one-line errors with exit code 1."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from retrofit.cli.main import main
from retrofit.surgery import load, load_any
from tests.surgery.tiny import tiny_model, tiny_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    tiny_model("gemma3").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_convert_macchiato(base, tmp_path, capsys):
    out = tmp_path / "mac"
    rc = main(["convert", str(base), "--method", "macchiato", "--out", str(out), "--window", "8",
               "--latents", "8", "--conv-size", "3", "--layers", "1", "--probe-tokens", "48"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "converted 1/2 layers" in text and "KL(SWA anchor || converted)" in text and str(out) in text
    model = load(out)
    rec = model.config.retrofit
    assert (rec["window"], rec["latents"], rec["conv_size"], rec["converted_layers"]) == (8, 8, 3, [1])
    assert rec["base_model"] == str(base)
    assert load_any(out)[1] is not None  # tokenizer saved next to the weights


def test_rope_cap_flag(base, tmp_path, capsys):
    """--rope-cap reaches the record and the kept full-attention layer (layer 1 here; layer 0 slides)."""
    from retrofit.surgery.rope_cap import capped_layers

    out = tmp_path / "capped"
    assert main(["convert", str(base), "--out", str(out), "--window", "8", "--latents", "8", "--layers", "0",
                 "--rope-cap", "12", "--probe-tokens", "0"]) == 0
    assert "layers 1 stay full attention with RoPE distances capped at 12 tokens" in capsys.readouterr().out
    model = load(out)
    assert model.config.retrofit["rope_cap"] == 12 and capped_layers(model) == {1: 12}
    _fails(["convert", str(base), "--out", str(tmp_path / "bad"), "--rope-cap", "-3"], capsys, "rope_cap must be")


def test_convert_exp_linear_delta_and_yaml(base, tmp_path, capsys):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text("method: exp-linear\nchunk_size: 16\n")
    out = tmp_path / "exp-delta"
    assert main(["convert", str(base), "--config", str(cfg), "--out", str(out), "--delta", "--probe-tokens", "0"]) == 0
    manifest = json.loads((out / "retrofit_delta.json").read_text())
    assert manifest["retrofit"]["method"] == "exp-linear" and manifest["parameters"] == []
    model, tok = load_any(out)
    assert model.config.retrofit["chunk_size"] == 16 and tok is not None


def _fails(argv, capsys, match):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "retrofit convert: error:" in err and match in err, err
    return err


def test_errors(base, tmp_path, capsys):
    out = tmp_path / "o"
    _fails(["convert", str(base), "--method", "lavo2", "--out", str(out)], capsys, "unknown method 'lavo2'")
    _fails(["convert", str(base), "--latents", "10", "--out", str(out), "--probe-tokens", "0"], capsys,
           "does not split over the model's 4 query heads")
    _fails(["convert", str(base), "--init-swa-share", "0", "--out", str(out)], capsys, "init_swa_share")
    _fails(["convert", str(base), "--layers", "7", "--out", str(out), "--probe-tokens", "0"], capsys, "do not exist")
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    _fails(["convert", str(gpt2), "--out", str(out)], capsys, "has no retrofit patch. Supported families: gemma")
    _fails(["convert", str(tmp_path / "missing"), "--out", str(out)], capsys, "does not exist")
    assert not out.exists()  # nothing partial on disk
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _fails(["convert", str(base), "--out", str(out), "--window", "8", "--latents", "8"], capsys, "already exists")
    assert os.listdir(out) == ["keep.txt"]
    # --overwrite replaces checkpoints only, never a folder holding other files
    _fails(["convert", str(base), "--out", str(out), "--window", "8", "--latents", "8", "--overwrite",
            "--probe-tokens", "0"], capsys, "not a checkpoint folder")
    assert os.listdir(out) == ["keep.txt"]
    (out / "keep.txt").unlink()
    out.rmdir()
    for window in ("8", "4"):  # a fresh write, then a replacement of that checkpoint
        assert main(["convert", str(base), "--out", str(out), "--window", window, "--latents", "8", "--overwrite",
                     "--probe-tokens", "0"]) == 0
    assert (out / "config.json").is_file() and '"window": 4' in (out / "config.json").read_text()


@pytest.mark.parametrize("method,flags,check", [
    ("lavo", ["--window", "8", "--option", "bases=4", "--option", "global_weight=0.25"],
     lambda rec: rec["bases"] == 4 and rec["global_weight"] == 0.25),
    ("lavo", ["--window", "8", "--bases", "4", "--global-weight", "0.25", "--no-dissect"],
     lambda rec: rec["bases"] == 4 and rec["global_weight"] == 0.25 and rec["dissect"] is False),
    ("llp", ["--segment", "16"], lambda rec: rec["segment"] == 16),
    ("delta", ["--window", "8", "--sinks", "2", "--memory-half-life", "64"],
     lambda rec: rec["window"] == 8 and rec["sinks"] == 2 and rec["memory_half_life"] == 64),
])
def test_lavo_and_llp_from_a_fresh_process(base, tmp_path, method, flags, check):
    """The built-in registry knows every method without any test-side registration."""
    import subprocess
    import sys

    out = tmp_path / method
    cmd = [sys.executable, "-m", "retrofit.cli.main", "convert", str(base), "--method", method,
           "--out", str(out), "--probe-tokens", "0", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    load_code = (f"import retrofit; m = retrofit.load({str(out)!r}); "
                 f"import json; print(json.dumps(m.config.retrofit))")
    proc = subprocess.run([sys.executable, "-c", load_code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["method"] == method and check(rec)


def test_option_must_be_key_value(base, tmp_path, capsys):
    rc = main(["convert", str(base), "--method", "lavo", "--out", str(tmp_path / "x"), "--option", "bases"])
    assert rc == 1
    assert "--option expects KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
