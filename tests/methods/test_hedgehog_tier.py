"""A Hedgehog conversion with an exact tier (``tier`` > 0): a prefill and a token-by-token decode give the
same logits and keep the same tokens; with room for every token and the read's keys the pretrained
ones it is the base model exactly; its cache stays bounded; the tier survives save / load and the
eval's zero-shot variant sets it."""
from __future__ import annotations

import pytest
import torch

from retrofit.layers.tier import TierLayerCache, set_tier, tier_layers
from retrofit.surgery import convert
from tests.methods._common import batch, perturb_new_weights, stepwise_logits, tiny_model

W = 6


def _tiered(family="llama", capacity=3, rule="recall", block=4, retrieve=0, **options):
    model = convert(tiny_model(family), method="hedgehog", window=W, options={"features": 8, "sinks": 2, **options})
    perturb_new_weights(model)
    assert set_tier(model, capacity, rule, block, retrieve=retrieve) == model.config.num_hidden_layers
    return model


@pytest.mark.parametrize("rule", ["recall", "norm", "recency"])
@pytest.mark.parametrize("distance", [None, 5])
def test_prefill_equals_stepwise_decoding_and_keeps_the_same_tokens(rule, distance):
    model = _tiered(rule=rule, memory_distance=distance)
    ids, mask, _ = batch(T=40, left_pad=(0, 5))
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
    steps, cache = stepwise_logits(model, ids, mask, prefill=9, slots=True, chunk_after=20)
    real = mask.bool()
    torch.testing.assert_close(steps[real], full[real], rtol=1e-4, atol=1e-4)
    _, prefilled = stepwise_logits(model, ids, mask, prefill=40, slots=True)
    for a, b in zip(cache.layers, prefilled.layers):
        assert isinstance(a, TierLayerCache)
        assert torch.equal(a.tier.tier_index, b.tier.tier_index) and a.tier.frontier == b.tier.frontier


def test_a_tier_holding_every_token_is_the_base_model():
    base = tiny_model("llama")
    model = _tiered(capacity=64, sink_distance=0)  # true distances, sinks never capped
    ids, mask, _ = batch(T=40, left_pad=(0, 5))
    with torch.no_grad():
        want, got = base(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-4)


def test_without_a_tier_the_layer_is_the_plain_hedgehog_read():
    a = _tiered(capacity=3)
    b = _tiered(capacity=3)
    set_tier(b, 0)
    ids, mask, _ = batch(T=30)
    with torch.no_grad():
        plain = convert(tiny_model("llama"), method="hedgehog", window=W, options={"features": 8, "sinks": 2})
        perturb_new_weights(plain)
        torch.testing.assert_close(b(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
        assert not torch.allclose(a(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)


def test_the_cache_stays_bounded():
    model = _tiered(capacity=3, block=4)
    sizes = []
    for T in (60, 120):
        ids, mask, _ = batch(B=1, T=T, left_pad=(0,))
        _, cache = stepwise_logits(model, ids, mask, prefill=T, slots=True)
        sizes.append(sum(layer.memory_bytes() for layer in cache.layers))
    assert sizes[1] <= sizes[0] * 1.1


def test_the_tier_survives_save_and_load(tmp_path):
    import retrofit
    from retrofit.surgery import save

    model = convert(tiny_model("llama"), method="hedgehog", window=W,
                    options={"features": 8, "sinks": 2, "tier": 3, "tier_rule": "norm", "tier_block": 4})
    perturb_new_weights(model)
    assert [(m.tier, m.tier_rule, m.tier_block) for m in tier_layers(model)][0] == (3, "norm", 4)
    save(model, tmp_path / "m")
    loaded = retrofit.load(tmp_path / "m")
    assert [(m.tier, m.tier_rule, m.tier_block) for m in tier_layers(loaded)][0] == (3, "norm", 4)
    ids, mask, _ = batch(T=30)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_the_zero_shot_variant_sets_the_tier_on_a_copy():
    from retrofit.errors import RetrofitError
    from retrofit.eval.variants import apply_variant, parse_variant

    model = _tiered(capacity=0)
    apply_variant(model, parse_variant("tier-recency:5"))
    assert {(m.tier, m.tier_rule) for m in tier_layers(model)} == {(5, "recency")}
    assert parse_variant("tier:512").label("m") == "m + exact tier 512 (recall)"
    with pytest.raises(RetrofitError, match="tier"):
        parse_variant("tier:0")
    with pytest.raises(RetrofitError, match="Hedgehog"):
        apply_variant(tiny_model("llama"), parse_variant("tier:4"))


# block retrieval: every settled block kept, each query reading its best blocks exactly


def _retrieving(retrieve=2, **options):
    return _tiered(capacity=0, retrieve=retrieve, **options)


@pytest.mark.parametrize("distance", [None, 5])
def test_retrieval_prefill_equals_stepwise_decoding(distance):
    model = _retrieving(memory_distance=distance)
    ids, mask, _ = batch(T=40, left_pad=(0, 5))
    # no token twice in a row: position-free read keys of a repeated token tie exactly in the first layer, and
    # which of two tied blocks a query reads is then decided by rounding, which differs between shapes
    ids = torch.stack([torch.randperm(200, generator=torch.Generator().manual_seed(b))[:40] + 3 for b in range(2)])
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
    steps, cache = stepwise_logits(model, ids, mask, prefill=9, slots=True, chunk_after=20)
    real = mask.bool()
    torch.testing.assert_close(steps[real], full[real], rtol=1e-4, atol=1e-4)
    assert all(isinstance(layer, TierLayerCache) and layer.tier.store_keys.shape[2] == layer.tier.frontier > 0
               for layer in cache.layers)


def test_retrieving_every_block_changes_the_read_and_the_cache_grows():
    plain = _retrieving(retrieve=0)
    every = _retrieving(retrieve=64)
    ids, mask, _ = batch(T=40)
    with torch.no_grad():
        assert not torch.allclose(every(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
    sizes = []
    for T in (60, 120):
        ids, mask, _ = batch(B=1, T=T, left_pad=(0,))
        _, cache = stepwise_logits(every, ids, mask, prefill=T, slots=True)
        sizes.append(sum(layer.memory_bytes() for layer in cache.layers))
    assert sizes[1] > sizes[0] * 1.5  # the store holds every settled token: unbounded, as documented


def test_retrieval_survives_save_and_load_and_refuses_a_tier(tmp_path):
    import retrofit
    from retrofit.errors import RetrofitError
    from retrofit.eval.variants import apply_variant, parse_variant
    from retrofit.surgery import save

    model = convert(tiny_model("llama"), method="hedgehog", window=W, options={"features": 8, "retrieve": 3})
    save(model, tmp_path / "m")
    assert {m.retrieve for m in tier_layers(retrofit.load(tmp_path / "m"))} == {3}
    with pytest.raises(Exception, match="retrieve"):
        convert(tiny_model("llama"), method="hedgehog", window=W, options={"features": 8, "retrieve": 3, "tier": 4})
    plain = _retrieving(retrieve=0)
    apply_variant(plain, parse_variant("retrieve:8"))
    assert {(m.tier, m.retrieve) for m in tier_layers(plain)} == {(0, 8)}
    assert parse_variant("retrieve:8").label("m") == "m + retrieval of 8 blocks"
    with pytest.raises(RetrofitError, match="retrieve"):
        parse_variant("retrieve:0")


def test_retrieval_in_some_layers_leaves_the_others_as_the_read():
    model = _retrieving()
    plain = _retrieving(retrieve=0)
    plain.load_state_dict(model.state_dict())
    assert set_tier(model, 0, retrieve=2, layers=[1]) == 1
    assert [layer.retrieve for layer in tier_layers(model)] == [0, 2]
    ids, mask, _ = batch(T=40)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
        ref = plain(ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[1], ref.hidden_states[1])  # layer 0 has no retrieval
    assert not torch.allclose(out.logits, ref.logits)
    with pytest.raises(ValueError, match=r"Hedgehog layers \(0-1\), got \[2\]"):
        set_tier(model, 0, retrieve=2, layers=[2])
