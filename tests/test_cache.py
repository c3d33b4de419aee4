"""RetrofitCache / RetrofitLayerCache: structure, constant memory, adoption, batch re-indexing."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from retrofit.layers.cache import RetrofitCache, RetrofitLayerCache, layer_cache
from retrofit.surgery import ConversionSpec, convert
from tests.surgery.tiny import tiny_model

W = 8


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _decode(model, ids, cache, prefill):
    """Prefill, then one token at a time; returns per-step memory of the converted layers."""
    sizes = []
    with torch.no_grad():
        model(ids[:, :prefill], past_key_values=cache, use_cache=True)
        for t in range(prefill, ids.shape[1]):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            sizes.append(sum(l.memory_bytes() for l in cache.layers if isinstance(l, RetrofitLayerCache)))
    return sizes


def test_structure_follows_the_conversion():
    model = tiny_model("gemma2")  # layer 0 natively sliding (24), layer 1 global
    convert(model, ConversionSpec(window=W, latents=8, layers=[1]))
    cache = RetrofitCache(model)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
    assert isinstance(cache.layers[1], RetrofitLayerCache) and cache.layers[1].window == W
    model = convert(tiny_model("llama"), ConversionSpec(window=W, latents=8, layers=[0]))
    cache = RetrofitCache(model)
    assert isinstance(cache.layers[0], RetrofitLayerCache) and type(cache.layers[1]) is DynamicLayer


@pytest.mark.parametrize("method", ["macchiato", "exp-linear"])
def test_memory_stops_growing(method):
    keys = dict(window=W, latents=8, conv_size=3) if method == "macchiato" else {}  # exp-linear has none of them
    model = convert(tiny_model("gemma3"), ConversionSpec(method=method, **keys))
    cache = RetrofitCache(model)
    sizes = _decode(model, torch.randint(3, 256, (2, 60)), cache, prefill=3)
    assert cache.get_seq_length() == 60
    assert len(set(sizes)) == 1  # decoding slots are allocated once, at the first step
    if method == "macchiato":
        assert all(l.in_slots and l.buffered == W - 1 for l in cache.layers)
        assert sizes[0] >= 2 * W * 8 * 4  # keys and values of w ring slots (8 dims, fp32) at least


def test_plain_dynamic_cache_is_adopted():
    model = convert(tiny_model("llama"), ConversionSpec(window=W, latents=8))
    cache = DynamicCache(config=model.config)
    sizes = _decode(model, torch.randint(3, 256, (1, 40)), cache, prefill=5)
    assert all(isinstance(l, RetrofitLayerCache) for l in cache.layers)
    assert len(set(sizes[W:])) == 1


def test_a_cache_filled_by_softmax_attention_is_refused():
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    with pytest.raises(ValueError, match="already holds softmax keys"):
        layer_cache(cache, 0, lambda: RetrofitLayerCache(window=W))
    assert isinstance(layer_cache(cache, 1, lambda: RetrofitLayerCache(window=W)), RetrofitLayerCache)


def test_reorder_and_select_follow_the_batch():
    """Swapping the batch rows of a filled cache == prefilling the swapped batch."""
    model = convert(tiny_model("gemma2"), ConversionSpec(window=W, latents=8, conv_size=2))
    ids = torch.randint(3, 256, (2, 30))
    nxt = torch.randint(3, 256, (2, 1))
    with torch.no_grad():
        a = RetrofitCache(model)
        model(ids, past_key_values=a, use_cache=True)
        a.reorder_cache(torch.tensor([1, 0]))
        got = model(nxt.flip(0), past_key_values=a, use_cache=True).logits
        b = RetrofitCache(model)
        model(ids.flip(0), past_key_values=b, use_cache=True)
        want = model(nxt.flip(0), past_key_values=b, use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        a.batch_select_indices(torch.tensor([1]))
        assert a.layers[1].state.m.shape[0] == 1 and a.layers[1].slot_keys.shape[0] == 1
    layer = a.layers[1]
    layer.crop(0)
    with pytest.raises(NotImplementedError, match="rolled back"):
        layer.crop(2)


# ---- in-place decoding slots ([sinks | ring of w]) against the general (concatenating) path
def _steps(model, ids, mask, prefill, slots: bool, chunk_after: int | None = None):
    """Logits of a prefill, then one token at a time (a multi-token chunk at ``chunk_after``)."""
    for m in model.modules():
        if hasattr(m, "slot_decoding"):
            m.slot_decoding = slots
    cache = RetrofitCache(model)
    outs = []
    with torch.no_grad():
        outs.append(model(ids[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache, use_cache=True).logits)
        t = prefill
        while t < ids.shape[1]:
            n = 5 if t == chunk_after else 1
            outs.append(model(ids[:, t : t + n], attention_mask=mask[:, : t + n], past_key_values=cache, use_cache=True).logits)
            t += n
    return torch.cat(outs, dim=1), cache


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
    assert layer.sink_distance == model.config.max_position_embeddings - 1 and layer.rope_inv_freq is not None
