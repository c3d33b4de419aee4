"""Tables name models by what they are (base + method + converted layers + training), not by folder."""
from __future__ import annotations

import json

from retrofit.eval import loading
from retrofit.surgery import load, load_any, save
from retrofit.surgery.checkpoint import TRAINING_FACTS

import retrofit


def test_converted_label_names_base_method_layers_and_training(base_dir, tokenizer, tmp_path):
    model, _ = load_any(str(base_dir))
    retrofit.convert(model, retrofit.ConversionSpec(method="macchiato", window=16, latents=8, sinks=2, layers=[1]))
    out = save(model, tmp_path / "final", tokenizer=tokenizer,
               card={"training": {"optimizer steps": 12, "training tokens": "6,144"}})
    assert json.loads((out / TRAINING_FACTS).read_text())["training"]["optimizer steps"] == 12
    _, _, label = loading.resolve(str(out))
    assert label == "tiny-base + macchiato (1/2 layers, w 16, L 8, 2 sinks), 12 steps / 6,144 tokens"
    assert "final" not in label  # the folder is a footnote (results.json's name_or_path), not the name
    loaded = load(out)
    loaded.config._name_or_path = str(out)
    assert loading.resolve(loaded, tokenizer)[2] == label


def test_base_label_is_its_name(base_dir):
    assert loading.resolve(str(base_dir))[2] == "tiny-base"
