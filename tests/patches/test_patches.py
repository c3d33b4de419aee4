"""Family patches: the family table and registry, and q/k/v/scaling/soft-capping read exactly as
each family computes them (separate or fused q/k/v projections)."""
from __future__ import annotations

import pytest
import torch
import transformers

from retrofit.errors import UnsupportedModelError
from retrofit.patches import get_patch, supported_model_types
from tests.surgery.tiny import FAMILIES, tiny_model


def test_registry_covers_every_family_of_the_test_table():
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
    q3 = tiny_model("qwen3")
    assert {"q_norm", "k_norm"} <= set(dict(get_patch(q3).submodules(q3.model.layers[0].self_attn)))
    assert [get_patch(q3).native_window(l.self_attn) for l in q3.model.layers] == [None, 24]  # per layer type
    phi = tiny_model("phi3")
    attn = phi.model.layers[0].self_attn
    assert set(dict(get_patch(phi).submodules(attn))) == {"qkv_proj", "o_proj"}
    assert get_patch(phi).qkv_split(attn) == (64, 32, 32)  # [Hq*d | Hkv*d | Hkv*d]
    assert get_patch(tiny_model("phi3", sliding_window=12)).native_window(attn) is None  # config.sliding_window
    assert get_patch(phi).native_window(tiny_model("phi3", sliding_window=12).model.layers[1].self_attn) == 12


def test_family_facts_live_in_the_table():
    """BOS and LoRA targets are read from the row (eval and train no longer know family names)."""
    from retrofit.patches import find_family

    assert [find_family(tiny_model(f)).needs_bos for f in FAMILIES] == [f.startswith("gemma") for f in FAMILIES]
    assert get_patch(tiny_model("llama")).lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert get_patch(tiny_model("phi3")).lora_targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # a multimodal wrapper is not convertible, but its text config still names the family's facts
    assert find_family(transformers.Gemma3Config()).name == "gemma3"
    assert find_family(transformers.GPT2Config()) is None and find_family(None) is None


def test_adding_a_family_is_one_row():
    """A new model_type on an existing modeling class: one Family row, and conversion is exact."""
    from retrofit.patches import Family, register_family
    from retrofit.surgery import ConversionSpec, convert
    from tests.surgery.tiny import band_reference

    model = tiny_model("llama")
    model.config.model_type = "test_llama_like"  # one config object, shared by every submodule
    with pytest.raises(UnsupportedModelError):
        get_patch(model)
    register_family(Family("llama-like", ("test_llama_like",), "transformers.models.llama.modeling_llama",
                           "LlamaAttention", needs_bos=True, lora_targets=("q_proj",)))
    try:
        assert get_patch(model).family == "llama-like" and supported_model_types()["test_llama_like"] == "llama-like"
        ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = band_reference(model, 8)(ids).logits
            got = convert(model, ConversionSpec(window=8, latents=8, init_swa_share=1.0))(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        from retrofit import patches

        patches._REGISTRY.pop("test_llama_like", None)


def test_a_family_that_differs_overrides_one_hook():
    from retrofit.patches import AttentionPatch, Family

    class Doubled(AttentionPatch):
        def scaling(self, module):
            return 2 * super().scaling(module)

    row = Family("odd", ("odd",), "transformers.models.llama.modeling_llama", "LlamaAttention", hooks=Doubled)
    attn = tiny_model("llama").model.layers[0].self_attn
    assert type(row.patch()) is Doubled and row.patch().scaling(attn) == pytest.approx(2 * 16**-0.5)
    with pytest.raises(ValueError, match="fused"):
        Family("bad", ("bad",), "m", "A", qkv=("q_proj", "kv_proj"))
    with pytest.raises(ValueError, match="window rule"):
        Family("bad", ("bad",), "m", "A", window="sometimes")
