"""Zero-shot layer ranking (KL of converting each layer alone) and `retrofit convert --keep-full`."""
from __future__ import annotations

import json

import pytest
import torch

from retrofit.cli.main import main
from retrofit.surgery import ConversionSpec, convert, load
from retrofit.surgery.probe import copy_probe_ids, kl_divergence, log_probs, rank_layers
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


def test_copy_probe_layout():
    tok = tiny_tokenizer()
    ids, last = copy_probe_ids(tok, 40, 256, seed=3)
    head = 1 if tok.bos_token_id is not None else 0
    assert ids.shape == (1, head + 80) and last == 40
    if head:
        assert ids[0, 0] == tok.bos_token_id
    first, second = ids[0, head:head + 40], ids[0, head + 40:]
    assert torch.equal(first, second) and len(set(first.tolist())) > 20  # random, repeated once
    assert not set(ids[0, head:].tolist()) & set(tok.all_special_ids)
    assert torch.equal(copy_probe_ids(tok, 40, 256, seed=3)[0], ids)  # seeded
    with pytest.raises(ValueError, match="span"):
        copy_probe_ids(tok, 1, 256)


def test_ranking_on_the_last_positions_equals_slicing_the_full_kl():
    ids, last = copy_probe_ids(None, 20, 256, seed=1)
    spec = ConversionSpec(window=6, latents=8, init_swa_share=0.5)
    ranking = rank_layers(tiny_model("llama", num_hidden_layers=3), spec, ids, last)
    base = log_probs(tiny_model("llama", num_hidden_layers=3), ids)[:, -last:]
    assert log_probs(tiny_model("llama", num_hidden_layers=3), ids, last).shape == base.shape
    for r in ranking:
        alone = convert(tiny_model("llama", num_hidden_layers=3), spec)
        originals = tiny_model("llama", num_hidden_layers=3)
        for j in range(3):
            if j != r["layer"]:
                alone.model.layers[j].self_attn = originals.model.layers[j].self_attn
        assert r["kl"] == pytest.approx(kl_divergence(base, log_probs(alone, ids)[:, -last:]), rel=1e-4, abs=1e-9)


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


def test_cli_rank_layers_on_the_copy_probe(base_dir, tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "rank-copy"
    assert main(["convert", str(base_dir), "--out", str(out), "--window", "6", "--latents", "8",
                 "--rank-layers", "--rank-probe", "copy", "--probe-tokens", "8"]) == 0
    saved = json.loads((out / "layer_ranking.json").read_text())
    assert saved["probe"] == "copy" and saved["scored_positions"] == 6 + 64  # span: beyond the window
    assert sorted(r["layer"] for r in saved["ranking"]) == [0, 1, 2]
    assert "second copy of 70 random tokens (69 positions back; window 6)" in capsys.readouterr().out
