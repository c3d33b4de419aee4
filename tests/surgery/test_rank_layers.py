"""Zero-shot layer ranking (KL of converting each layer alone) and `retrofit convert --keep-full`."""
from __future__ import annotations

import json

import pytest
import torch

from retrofit.cli.main import main
from retrofit.surgery import ConversionSpec, convert, load
from retrofit.surgery.probe import kl_divergence, log_probs, rank_layers
from tests.surgery.tiny import tiny_model, tiny_tokenizer


def test_ranking_equals_converting_each_layer_alone():
    ids = torch.randint(3, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    spec = ConversionSpec(window=6, latents=8, init_swa_share=0.5)
    ranking = rank_layers(tiny_model("llama", num_hidden_layers=3), spec, ids)
    assert [r["kl"] for r in ranking] == sorted((r["kl"] for r in ranking), reverse=True)
    base = log_probs(tiny_model("llama", num_hidden_layers=3), ids)
    for r in ranking:  # reference: the same conversion with the other layers' original modules put back
        alone = convert(tiny_model("llama", num_hidden_layers=3), spec)
        originals = tiny_model("llama", num_hidden_layers=3)
        for j in range(3):
            if j != r["layer"]:
                alone.model.layers[j].self_attn = originals.model.layers[j].self_attn
        assert r["kl"] == pytest.approx(kl_divergence(base, log_probs(alone, ids)), rel=1e-4, abs=1e-9)
    assert ranking[0]["kl"] > 0


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_model("llama", num_hidden_layers=3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_cli_rank_layers_and_keep_full(base_dir, tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "rank"
    assert main(["convert", str(base_dir), "--out", str(out), "--window", "6", "--latents", "8",
                 "--rank-layers", "--probe-tokens", "48"]) == 0
    ranking = json.loads((out / "layer_ranking.json").read_text())["ranking"]
    assert sorted(r["layer"] for r in ranking) == [0, 1, 2]
    assert not (out / "model.safetensors").exists()
    kept = tmp_path / "kept"
    assert main(["convert", str(base_dir), "--out", str(kept), "--window", "6", "--latents", "8",
                 "--keep-full", "1", "--probe-tokens", "48"]) == 0
    model = load(kept)
    assert model.config.retrofit["converted_layers"] == sorted(r["layer"] for r in ranking[1:])
    assert "keeping layers" in capsys.readouterr().out
    assert main(["convert", str(base_dir), "--out", str(tmp_path / "x"), "--keep-full", "3"]) == 1
