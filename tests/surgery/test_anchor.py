"""The exactness anchor on every family: latent path closed (p(0|t) = 1) == the original model run
with a w-token sliding window on the converted layers (independent dense reference, see tiny.py)."""
from __future__ import annotations

import pytest
import torch

from retrofit.surgery import ConversionSpec, convert
from tests.surgery.tiny import FAMILIES, band_reference, kl_divergence, tiny_model

W = 8


def _batch(T=45, pad=7):
    ids = torch.randint(3, 256, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0  # left padding in the second row
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_closed_latent_path_equals_sliding_window_original(family):
    model = tiny_model(family)
    ids, mask = _batch()
    reference = band_reference(model, W)
    with torch.no_grad():
        ref = reference(ids, attention_mask=mask).logits
        full = model(ids, attention_mask=mask).logits
    convert(model, ConversionSpec(window=W, latents=8, init_swa_share=1.0))
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)
    assert (full - ref)[valid].abs().max() > 1e-2  # the window really cuts (the test can fail)


@pytest.mark.parametrize("family", FAMILIES)
def test_closed_latent_path_with_sinks_equals_window_plus_sinks_original(family):
    model = tiny_model(family)
    ids, mask = _batch()
    reference = band_reference(model, W, sinks=2)
    with torch.no_grad():
        ref = reference(ids, attention_mask=mask).logits
        no_sinks = band_reference(model, W)(ids, attention_mask=mask).logits
    convert(model, ConversionSpec(window=W, latents=8, init_swa_share=1.0, sinks=2))
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)
    assert (no_sinks - ref)[valid].abs().max() > 1e-2  # the sinks really change the output


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_partial_conversion_keeps_other_layers_exact(family):
    """Only layer 1 converted; layer 0 stays softmax attention (Gemma 2: native 24-token window +
    soft-capping through the 'retrofit' SDPA/eager path; Mistral: native window 12)."""
    overrides = {"sliding_window": 12} if family == "mistral" else {}
    model = tiny_model(family, **overrides)
    ids, mask = _batch(T=40)
    reference = band_reference(model, W, layers=[1])
    with torch.no_grad():
        ref = reference(ids, attention_mask=mask).logits
    convert(model, ConversionSpec(window=W, latents=8, init_swa_share=1.0, layers=[1]))
    assert type(model.model.layers[0].self_attn).__name__.endswith("Attention")
    assert not getattr(model.model.layers[0].self_attn, "is_retrofit_attention", False)
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_default_share_stays_close_to_the_anchor(family, capsys):
    """At the default initial share the untrained latent states perturb the anchor a little; a
    lower share perturbs it more. KL values are printed for the record (-s)."""
    model = tiny_model(family)
    ids, mask = _batch()
    reference = band_reference(model, W)
    with torch.no_grad():
        ref = reference(ids, attention_mask=mask).logits
    kls = {}
    for share in (1.0, ConversionSpec().init_swa_share, 0.5):
        m = tiny_model(family)
        convert(m, ConversionSpec(window=W, latents=8, init_swa_share=share))
        with torch.no_grad():
            kls[share] = kl_divergence(ref, m(ids, attention_mask=mask).logits, mask)
    with capsys.disabled():
        print(f"\n[{family}] KL(SWA anchor || converted) by init share: " + ", ".join(f"{s}: {v:.2e}" for s, v in kls.items()))
    default = ConversionSpec().init_swa_share
    assert kls[1.0] < 1e-8
    assert 0 < kls[default] < kls[0.5]
    assert kls[default] < 0.1
