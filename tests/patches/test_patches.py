"""Family patches: registry, and q/k/v/scaling/soft-capping read exactly as each family computes them."""
from __future__ import annotations

import pytest
import torch
import transformers

from retrofit.errors import UnsupportedModelError
from retrofit.patches import get_patch, supported_model_types
from tests.surgery.tiny import FAMILIES, tiny_model


def test_registry_covers_the_six_families():
    families = set(supported_model_types().values())
    assert families == set(FAMILIES)
    for fam in FAMILIES:
        assert get_patch(tiny_model(fam)).family == fam
        assert get_patch(tiny_model(fam).config).family == fam  # a config works too


def test_unsupported_family_lists_the_supported_ones():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedModelError) as exc:
        get_patch(transformers.GPT2LMHeadModel(cfg))
    msg = str(exc.value)
    assert "gpt2" in msg and all(f in msg for f in FAMILIES)


def test_multimodal_gemma3_gets_a_hint():
    with pytest.raises(UnsupportedModelError, match="text-only"):
        get_patch(transformers.Gemma3Config())


def _captured_call(model, ids):
    """Run the model once and capture what the first decoder layer hands its attention."""
    seen = {}
    attn = model.model.layers[0].self_attn

    def hook(module, args, kwargs):
        seen.update(hidden_states=kwargs["hidden_states"], position_embeddings=kwargs["position_embeddings"])

    h = attn.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(ids)
    h.remove()
    return attn, seen["hidden_states"], seen["position_embeddings"]


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_reproduces_the_family_attention(family):
    """o_proj(softmax(cap(s q k^T)) v) from the patch's q, k, v == the module's own (unmasked) eager forward."""
    model = tiny_model(family)
    model.set_attn_implementation("eager")
    attn, x, pe = _captured_call(model, torch.randint(3, 256, (2, 11)))
    patch = get_patch(model)
    with torch.no_grad():
        expected, _ = attn(hidden_states=x, position_embeddings=pe, attention_mask=None)  # eager, no mask
        q, k, v = patch.project_qkv(attn, x, pe)
        hq, hkv = patch.num_heads(attn)
        assert q.shape == (2, hq, 11, patch.head_dim(attn)) and k.shape[1] == v.shape[1] == hkv
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        scores = q @ k.transpose(-1, -2) * patch.scaling(attn)
        cap = patch.softcap(attn)
        if cap:
            scores = torch.tanh(scores / cap) * cap
        got = patch.project_out(attn, torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_family_specifics():
    g2 = tiny_model("gemma2").model.layers[0].self_attn
    g3 = tiny_model("gemma3").model.layers[0].self_attn
    assert get_patch(tiny_model("gemma2")).scaling(g2) == pytest.approx(24**-0.5)  # query_pre_attn_scalar
    assert get_patch(tiny_model("gemma2")).softcap(g2) == 3.0
    assert get_patch(tiny_model("gemma3")).softcap(g3) is None  # Gemma 3 never soft-caps attention logits
    assert "q_norm" in dict(get_patch(tiny_model("gemma3")).submodules(g3))
    llama = tiny_model("llama").model.layers[0].self_attn
    assert get_patch(tiny_model("llama")).scaling(llama) == pytest.approx(16**-0.5)
