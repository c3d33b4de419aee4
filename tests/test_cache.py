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


@pytest.mark.parametrize("spec", [
    dict(method="exp-linear"), dict(method="lavo", window=W, bases=8), dict(method="llp", segment=8),
], ids=lambda s: s["method"])
def test_every_methods_state_follows_the_batch(spec):
    """Beam re-indexing reaches each method's own state (a dataclass of tensors) through the
    generic cache entry: swapped rows == the swapped batch prefilled; a selected row == that row."""
    model = convert(tiny_model("qwen2"), ConversionSpec(**spec))
    ids = torch.randint(3, 256, (2, 21))
    nxt = torch.randint(3, 256, (2, 1))
    with torch.no_grad():
        a = RetrofitCache(model)
        model(ids, past_key_values=a, use_cache=True)
        before = a.memory_bytes()
        a.reorder_cache(torch.tensor([1, 0]))
        got = model(nxt, past_key_values=a, use_cache=True).logits
        b = RetrofitCache(model)
        model(ids.flip(0), past_key_values=b, use_cache=True)
        want = model(nxt, past_key_values=b, use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        a = RetrofitCache(model)
        model(ids, past_key_values=a, use_cache=True)
        a.batch_select_indices(torch.tensor([1]))
        assert 0 < a.memory_bytes() < before
        got = model(nxt[1:], past_key_values=a, use_cache=True).logits
        c = RetrofitCache(model)
        model(ids[1:], past_key_values=c, use_cache=True)
        want = model(nxt[1:], past_key_values=c, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
