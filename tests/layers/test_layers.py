"""Replacement layers: pretrained weights shared by name, new weights and their initial values,
and each layer equal to the dense references of its op on the patch's q, k, v."""
from __future__ import annotations

import pytest
import torch

from retrofit.layers import ExpLinearAttention, MacchiatoAttention, swa_bias
from retrofit.ops import exp_linear_attention_reference, macchiato_attention_reference, repeat_kv_heads
from retrofit.patches import get_patch
from retrofit.surgery import ConversionSpec, convert, new_parameter_names
from tests.surgery.tiny import tiny_model


def _attention_inputs(model, T=37, B=2):
    """hidden states and (cos, sin) exactly as the first decoder layer passes them."""
    seen = {}
    attn = model.model.layers[0].self_attn
    h = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(3, 256, (B, T)))
    h.remove()
    return seen["hidden_states"], seen["position_embeddings"]


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_pretrained_submodules_are_moved_not_copied(family):
    model = tiny_model(family)
    before = {k: v for k, v in model.state_dict().items()}
    names = get_patch(model).submodule_names  # phi3: the fused qkv_proj and o_proj
    assert set(names) >= ({"qkv_proj", "o_proj"} if family == "phi3" else {"q_proj", "k_proj", "v_proj", "o_proj"})
    originals = {n: getattr(model.model.layers[0].self_attn, n) for n in names}
    convert(model, ConversionSpec(window=8, latents=8, conv_size=3))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, MacchiatoAttention)
    for n, module in originals.items():
        assert getattr(attn, n) is module  # same objects: shared weights, unchanged keys
    after = model.state_dict()
    assert set(before) <= set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    added = sorted(set(after) - set(before))
    assert added == sorted(new_parameter_names(model))
    assert {k.split("self_attn.")[1] for k in added} == {"latent_q.weight", "latent_q.bias", "latent_k.weight", "conv.weight"}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(new_parameter_names(model))


@pytest.mark.parametrize("share", [0.9, 0.5, 1.0])
def test_initial_swa_share_is_exact_for_every_token(share):
    model = tiny_model("llama")
    x, _ = _attention_inputs(model)
    convert(model, ConversionSpec(window=8, latents=12, init_swa_share=share))
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        mix, lat, _ = attn._mixing(x, None, None)
        p0 = torch.softmax(mix, -1)[..., 0]
    assert mix.shape == (2, 4, 37, 3 + 1) and lat.shape == (2, 4, 37, 3)
    torch.testing.assert_close(p0, torch.full_like(p0, share), rtol=0, atol=1e-6)
    assert swa_bias(share, 3) == (pytest.approx(torch.log(torch.tensor(share / (1 - share) * 3)).item()) if share < 1 else 1e4)


@pytest.mark.parametrize("family,conv", [("llama", 0), ("gemma2", 0), ("gemma3", 3)])
def test_macchiato_layer_equals_dense_reference(family, conv):
    """Layer output == o_proj(macchiato_attention_reference(q, k, v, latent_q(u), latent_k(u))) with trained-looking weights."""
    model = tiny_model(family)
    x, pe = _attention_inputs(model)
    patch = get_patch(model)
    convert(model, ConversionSpec(window=6, latents=8, conv_size=conv, chunk_size=8))
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in attn.named_parameters():
            if n.startswith(("latent_q", "latent_k", "conv")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        mask = torch.ones(2, 37, dtype=torch.bool)
        mask[1, :5] = False
        got, _ = attn(x, position_embeddings=pe, attention_mask=mask)
        q, k, v = patch.project_qkv(attn, x, pe)
        u = x * mask[..., None]
        if conv:  # the conv, written out: y_t = sum_i w[:, K-1-i] x_{t-i}
            w = attn.conv.weight[:, 0]
            u = sum(torch.nn.functional.pad(u, (0, 0, i, 0))[:, : u.shape[1]] * w[:, conv - 1 - i] for i in range(conv))
        mix = attn.latent_q(u).view(2, 37, 4, 3).transpose(1, 2)
        lat = attn.latent_k(u).view(2, 37, 4, 2).transpose(1, 2)
        ref = macchiato_attention_reference(q, k, v, mix, lat, window=6, scaling=patch.scaling(attn),
                                            softcap=patch.softcap(attn), key_padding_mask=mask)
        expected = patch.project_out(attn, ref)
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_exp_linear_layer_equals_reference(family):
    """phi = exp on sqrt(scaling) * (rotated q, k); GQA by repeating k, v over the query group."""
    model = tiny_model(family)
    x, pe = _attention_inputs(model)
    patch = get_patch(model)
    convert(model, ConversionSpec(method="exp-linear", chunk_size=8))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, ExpLinearAttention) and new_parameter_names(model) == []
    with torch.no_grad():
        got, _ = attn(x, position_embeddings=pe)
        q, k, v = patch.project_qkv(attn, x, pe)
        s = patch.scaling(attn) ** 0.5
        H = q.shape[1]
        ref = exp_linear_attention_reference(q * s, repeat_kv_heads(k, H) * s, repeat_kv_heads(v, H))
        expected = patch.project_out(attn, ref)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_latents_must_split_over_heads():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="multiple of the 4 query heads"):
        MacchiatoAttention(model.model.layers[0].self_attn, get_patch(model), window=8, latents=10)


def test_only_new_weights_get_gradients():
    model = tiny_model("qwen2")
    convert(model, ConversionSpec(window=4, latents=8, conv_size=2))
    model.train()
    out = model(torch.randint(3, 256, (2, 20)), labels=torch.randint(3, 256, (2, 20)))
    out.loss.backward()
    new = set(new_parameter_names(model))
    for n, p in model.named_parameters():
        if n in new:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n


def test_pure_sliding_window_baseline_with_zero_latents():
    model = tiny_model("llama")
    convert(model, ConversionSpec(window=8, latents=0))
    assert {n.split("self_attn.")[1] for n in new_parameter_names(model)} == {"latent_q.weight", "latent_q.bias"}
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 256, (1, 30))).logits).all()
