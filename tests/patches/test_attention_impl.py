"""The "retrofit" attention implementation: 2D masks only, and unconverted layers still exact."""
from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from retrofit.patches.attention import IMPLEMENTATION, install_attention_function
from tests.surgery.tiny import tiny_model


def _padded_batch(T=40, pad=9):
    ids = torch.randint(3, 256, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask


def test_masks_stay_2d_or_none():
    install_attention_function()
    model = tiny_model("gemma2")
    model.set_attn_implementation(IMPLEMENTATION)
    emb = torch.zeros(2, 40, 64)
    _, mask = _padded_batch()
    for fn in (create_causal_mask, create_sliding_window_causal_mask):
        m = fn(config=model.config, inputs_embeds=emb, attention_mask=mask, past_key_values=None)
        assert m.shape == (2, 40) and m.dtype == torch.bool and torch.equal(m, mask.bool())
        assert fn(config=model.config, inputs_embeds=emb, attention_mask=torch.ones(2, 40), past_key_values=None) is None


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_unconverted_model_matches_eager(family):
    """Full attention, native sliding windows (Gemma 2/3: 24 < T) and soft-capping, with left padding."""
    install_attention_function()
    model = tiny_model(family)
    ids, mask = _padded_batch()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    model.set_attn_implementation(IMPLEMENTATION)
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)


def test_unconverted_model_decodes_with_cache():
    install_attention_function()
    model = tiny_model("gemma2")
    model.set_attn_implementation(IMPLEMENTATION)
    ids, mask = _padded_batch(T=50)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :30], attention_mask=mask[:, :30], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(30, 50):
            o = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True,
                      position_ids=(mask[:, : t + 1].cumsum(-1) - 1)[:, -1:])
            steps.append(o.logits)
    # full forward without position_ids counts pads as positions; compare the unpadded row only
    torch.testing.assert_close(torch.cat(steps, 1)[0], full[0], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(torch.cat(steps, 1)).all()
