"""``--method macchiato``: the layer (pretrained weights shared by name, new weights and their
initial values, equal to the dense reference of its op on the patch's q, k, v, gradients only to
the new weights) and its decoding cache (in-place window slots against the general path, beam
re-indexing, attention sinks re-positioned past the cap)."""
from __future__ import annotations

import pytest
import torch

from retrofit.layers import MacchiatoAttention, swa_bias
from retrofit.layers.cache import RetrofitCache, RetrofitLayerCache
from retrofit.ops import macchiato_attention_reference
from retrofit.patches import get_patch
from retrofit.surgery import ConversionSpec, convert, new_parameter_names
from tests.methods._common import attention_inputs as _attention_inputs
from tests.methods._common import stepwise_logits as _steps
from tests.surgery.tiny import tiny_model

W = 8


# ---------------------------------------------------------------------- the layer
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
        mix, lat, _ = attn.mixing_logits(x, None, None)
        p0 = torch.softmax(mix, -1)[..., 0]
    assert mix.shape == (2, 4, 37, 3 + 1) and lat.shape == (2, 4, 37, 3)
    torch.testing.assert_close(p0, torch.full_like(p0, share), rtol=0, atol=1e-6)
    assert swa_bias(share, 3) == (pytest.approx(torch.log(torch.tensor(share / (1 - share) * 3)).item()) if share < 1 else 1e4)

def test_decoding_projection_is_the_two_projections_and_follows_their_updates():
    """One token without grad takes both latent projections in one stacked product; it equals the two
    separate ones, and an in-place weight update (an optimizer step, load_state_dict) is seen at once."""
    model = tiny_model("llama")
    convert(model, ConversionSpec(window=8, latents=12, init_swa_share=0.7))
    attn = model.model.layers[0].self_attn
    torch.nn.init.normal_(attn.latent_q.weight, std=0.3)
    x = torch.randn(2, 1, model.config.hidden_size)
    for step in range(3):
        with torch.no_grad():
            fused = attn.mixing_logits(x, None, None)
            assert attn._fused is not None  # the stacked path ran
        separate = attn.mixing_logits(x, None, None)  # grad enabled: the two modules
        for a, b in zip(fused[:2], separate[:2]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        with torch.no_grad():  # in place, as an optimizer step
            attn.latent_q.weight.add_(0.5)
            attn.latent_k.weight.mul_(-2.0)
            attn.latent_q.bias.sub_(0.25)


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


# ---------------------------------------------------------------------- decoding slots [sinks | ring of w] vs the general path
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: GQA + attention softcap
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("prefill", [3, 20])  # window not yet full / full at the first step
def test_slot_decoding_equals_the_general_path(family, sinks, prefill):
    """Left-padded rows, several wraps of the ring, a chunk after decoding (back to chronological)."""
    model = convert(tiny_model(family), ConversionSpec(window=W, latents=8, conv_size=2, sinks=sinks))
    ids = torch.randint(3, 256, (2, 60))
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :4] = 0  # row 1 starts with 4 padding tokens: they never become sinks or window keys
    mask[0, 50] = mask[1, 30] = 0  # a padded token while decoding: zero output, no key, state kept
    want, _ = _steps(model, ids, mask, prefill, slots=False, chunk_after=41)
    got, cache = _steps(model, ids, mask, prefill, slots=True, chunk_after=41)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # back in slots after the chunk, and the window is the last w tokens
    layer = next(l for l in cache.layers if isinstance(l, RetrofitLayerCache))
    assert layer.in_slots and layer.buffered == W - 1 and layer.cumulative_length == 60
    k, _, ok = layer.past_kv()  # leaves the slots: chronological again
    assert not layer.in_slots and k.shape[2] == W - 1 and bool(ok.all())

def test_slots_follow_beam_reordering():
    model = convert(tiny_model("llama"), ConversionSpec(window=W, latents=8, sinks=1))
    ids = torch.randint(3, 256, (2, 25))
    with torch.no_grad():
        a = RetrofitCache(model)
        model(ids[:, :20], past_key_values=a, use_cache=True)
        for t in range(20, 25):
            model(ids[:, t : t + 1], past_key_values=a, use_cache=True)
        assert a.layers[0].in_slots
        a.reorder_cache(torch.tensor([1, 0]))
        nxt = torch.randint(3, 256, (2, 1))
        got = model(nxt, past_key_values=a, use_cache=True).logits
        b = RetrofitCache(model)
        model(ids.flip(0), past_key_values=b, use_cache=True)
        want = model(nxt, past_key_values=b, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- sinks re-positioned past the cap (sink_distance): every path scores them the same way
@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])  # phi3: partial rotary
def test_capped_sinks_agree_across_paths(family):
    """One whole forward, the general cached path and the slot path give the same logits when the
    cap is active on most tokens; the cap changes nothing before it and something after it."""
    T, cap = 60, 14
    model = convert(tiny_model(family), ConversionSpec(window=W, latents=8, sinks=2, sink_distance=cap))
    ids = torch.randint(3, 256, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :4] = 0
    mask[0, 50] = 0
    with torch.no_grad():
        whole = model(ids, attention_mask=mask).logits
    general, _ = _steps(model, ids, mask, 20, slots=False, chunk_after=41)
    slots, _ = _steps(model, ids, mask, 20, slots=True, chunk_after=41)
    real = mask.bool()
    torch.testing.assert_close(general[real], whole[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(slots[real], whole[real], rtol=1e-4, atol=1e-4)

    uncapped = convert(tiny_model(family), ConversionSpec(window=W, latents=8, sinks=2, sink_distance=0))
    with torch.no_grad():
        plain = uncapped(ids, attention_mask=mask).logits
    near = torch.arange(T) <= cap  # no query is farther than the cap from any token yet
    torch.testing.assert_close(whole[:, near], plain[:, near], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(whole[:, ~near], plain[:, ~near], atol=1e-3)

def test_default_cap_is_the_pretraining_context():
    model = convert(tiny_model("gemma3"), ConversionSpec(window=W, latents=8, sinks=2))
    assert model.config.retrofit["sink_distance"] == model.config.max_position_embeddings - 1
    layer = next(m for m in model.modules() if hasattr(m, "sink_distance"))
    assert layer.sink_distance == model.config.max_position_embeddings - 1 and layer.sink_inv_freq is not None
