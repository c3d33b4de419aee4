"""LAVO / LLP / the delta-rule memory through the surgery's checkpoints: full save/load and delta re-attachment give the
same logits; LAVO's trained weights survive; the probe's closed path is LAVO's SWA anchor."""
from __future__ import annotations

import pytest
import torch

from retrofit.surgery import convert, load, load_delta, save, save_delta
from tests.methods._common import batch, pattern_reference, tiny_model

SPECS = {
    "lavo": dict(method="lavo", window=6, options={"bases": 8, "global_weight": 0.3}),
    "lavo-fixed-gate": dict(method="lavo", window=6, options={"global_weight": 0.3, "learn_global_weight": False, "relative_bias": False}),
    "llp": dict(method="llp", options={"segment": 6}),
    "delta": dict(method="delta", window=6, options={"sinks": 2, "init_swa_share": 0.6}),
    "hedgehog": dict(method="hedgehog", window=6, options={"sinks": 2, "features": 8}),
}


def _perturb_new_weights(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_full_and_delta_roundtrip(name, tmp_path):
    base_dir = tmp_path / "base"
    tiny_model("gemma2").save_pretrained(base_dir)
    model = convert(tiny_model("gemma2"), **SPECS[name])
    _perturb_new_weights(model)  # "trained" weights must come back, not the initial ones
    ids, mask, pos = batch(T=20)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits

    save(model, tmp_path / "full")
    save_delta(model, tmp_path / "delta", base_model=str(base_dir))
    full = load(tmp_path / "full")
    delta, _ = load_delta(tmp_path / "delta")
    for loaded in (full, delta):
        assert loaded.config.retrofit["method"] == SPECS[name]["method"]
        with torch.no_grad():
            got = loaded(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_probe_closed_path_is_the_lavo_anchor():
    from retrofit.surgery.probe import closed_latent_path

    base = tiny_model("qwen2")
    ref = pattern_reference(base, lambda qr, kr: (kr <= qr) & (kr > qr - 6))
    model = convert(base, **SPECS["lavo"])
    _perturb_new_weights(model)  # a trained bias and gate are switched off too
    ids, mask, pos = batch(T=25)
    with torch.no_grad(), closed_latent_path(model) as closed:
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert closed == 2
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-4, rtol=2e-4)
    with torch.no_grad():
        opened = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert not torch.allclose(opened[mask.bool()], want[mask.bool()], atol=1e-2)
