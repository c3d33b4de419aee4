"""The three-tier attention (window, bounded exact tier, linear read) against its fp64 definition."""
from __future__ import annotations

import pytest
import torch

from retrofit.ops.exact_tier import TIER_RULES, settle_frontier, tiered_attention, tiered_attention_reference
from retrofit.ops.hedgehog import hedgehog_features
from retrofit.ops.sdpa import repeat_kv_heads
from retrofit.ops.sinks import first_valid

B, HQ, HKV, D, FEAT = 2, 4, 2, 8, 6
INV_FREQ = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)


def _inputs(T: int, seed: int = 0, dtype=torch.float64, big: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, HQ, T, D) * big, r(B, HKV, T, D) * big, r(B, HKV, T, D)
    mq, mk = r(B, HQ, T, D), r(B, HKV, T, D)
    wq, wk = r(HQ, FEAT, D), r(HQ, FEAT, D)
    fq = hedgehog_features(mq, wq)
    scale = r(B, HQ, T) * 0.5 + 1.0
    count_weight = r(HQ) * 0.2
    cast = lambda x: x.to(dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), mq=cast(mq), mk=cast(mk), fq=cast(fq), scale=cast(scale)), wk, count_weight


def _sinks(n: int, valid: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    idx = torch.arange(k.shape[2])[None].expand(B, -1)
    return first_valid(n, idx, valid, k, v)


def _run(x, wk, cw, *, steps=None, sinks_n=0, valid=None, **kw):
    """The op over the sequence in calls of the given sizes (None: one prefill)."""
    T = x["q"].shape[2]
    steps = steps or [T]
    outs, state, start = [], None, 0
    for size in steps:
        sl = slice(start, start + size)
        part = {name: t[:, :, sl] for name, t in x.items()}
        pv = None if valid is None else valid[:, sl]
        sinks = None
        if sinks_n:
            seen_valid = torch.ones(B, start + size, dtype=torch.bool) if valid is None else valid[:, : start + size]
            sinks = _sinks(sinks_n, seen_valid, x["k"][:, :, : start + size], x["v"][:, :, : start + size])
        out, state = tiered_attention(**part, feature_key_weight=wk.to(x["q"].dtype), count_weight=cw, key_padding_mask=pv,
                                      sinks=sinks, state=state, **kw)
        outs.append(out)
        start += size
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize("rule", TIER_RULES)
def test_prefill_equals_the_definition(rule):
    x, wk, cw = _inputs(41)
    kw = dict(window=6, block=4, capacity=3, rule=rule, sink_distance=12, inv_freq=INV_FREQ)
    out, state = _run(x, wk, cw, sinks_n=2, **kw)
    ref = tiered_attention_reference(**x, feature_key_weight=wk, count_weight=cw, num_sinks=2, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert state.keys.shape[2] <= 6 + 4 - 1 and state.tier_keys.shape[2] == 3
    assert int(state.count.max()) > 0  # the memory was used


@pytest.mark.parametrize("steps", [[1] * 41, [17, 1, 1, 5, 1, 16], [3, 38]])
def test_any_split_into_calls_gives_the_same_outputs_and_keeps_the_same_tokens(steps):
    x, wk, cw = _inputs(41, seed=1)
    kw = dict(window=6, block=4, capacity=3, rule="recall", sink_distance=10, inv_freq=INV_FREQ)
    full, s_full = _run(x, wk, cw, sinks_n=2, **kw)
    split, s_split = _run(x, wk, cw, steps=steps, sinks_n=2, **kw)
    torch.testing.assert_close(split, full, rtol=1e-10, atol=1e-10)
    assert torch.equal(s_split.tier_index, s_full.tier_index) and s_split.frontier == s_full.frontier
    torch.testing.assert_close(s_split.S, s_full.S, rtol=1e-10, atol=1e-10)


def test_padding_is_never_read_nor_kept():
    x, wk, cw = _inputs(30, seed=2)
    valid = torch.ones(B, 30, dtype=torch.bool)
    valid[1, :7] = False  # left padding
    kw = dict(window=5, block=3, capacity=2, rule="recall")
    out, state = _run(x, wk, cw, sinks_n=1, valid=valid, **kw)
    ref = tiered_attention_reference(**x, feature_key_weight=wk, count_weight=cw, num_sinks=1, key_padding_mask=valid, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert out[1, :, :7].abs().max() == 0
    kept = state.tier_index[1][state.tier_index[1] >= 0]
    assert bool((kept >= 7).all())
    x2 = {n: t.clone() for n, t in x.items()}
    for name in ("k", "v", "mk"):
        x2[name][1, :, :7] = 1e6  # anything in the padding
    out2, _ = _run(x2, wk, cw, sinks_n=1, valid=valid, **kw)
    torch.testing.assert_close(out2[1, :, 7:], out[1, :, 7:], rtol=1e-10, atol=1e-10)


def test_a_tier_as_large_as_the_context_is_full_attention():
    """With the read's keys the pretrained ones and room for every token, nothing reaches the memory."""
    x, wk, cw = _inputs(37, seed=3)
    x["mq"], x["mk"] = x["q"], x["k"]
    out, state = _run(x, wk, cw, window=4, block=4, capacity=37, rule="recall")
    assert int(state.count.max()) == 0
    s = (x["q"] @ repeat_kv_heads(x["k"], HQ).transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.softmax(s, -1) @ repeat_kv_heads(x["v"], HQ)
    torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-10)


def test_recency_keeps_the_newest_settled_tokens_as_a_longer_window_would():
    x, wk, cw = _inputs(40, seed=4)
    _, state = _run(x, wk, cw, window=6, block=4, capacity=5, rule="recency")
    F = state.frontier
    assert F == settle_frontier(39, 6, 4)
    assert sorted(state.tier_index[0, 0].tolist()) == list(range(F - 5, F))


def test_selection_is_deterministic_with_ties_to_the_newer_token():
    x, wk, cw = _inputs(24, seed=5)
    x["mk"] = torch.ones_like(x["mk"])  # every key the same norm: a tie everywhere
    _, s1 = _run(x, wk, cw, window=4, block=4, capacity=3, rule="norm")
    _, s2 = _run(x, wk, cw, window=4, block=4, capacity=3, rule="norm")
    assert torch.equal(s1.tier_index, s2.tier_index)
    assert sorted(s1.tier_index[0, 0].tolist()) == [s1.frontier - 3, s1.frontier - 2, s1.frontier - 1]


def test_large_logits_stay_finite_and_bf16_follows_fp32():
    x, wk, cw = _inputs(33, seed=6, big=30.0)
    kw = dict(window=5, block=4, capacity=2, rule="recall", softcap=50.0)
    out, _ = _run(x, wk, cw, **kw)
    assert torch.isfinite(out).all()
    ref = tiered_attention_reference(**x, feature_key_weight=wk, count_weight=cw, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    x32, _, _ = _inputs(33, seed=7, dtype=torch.float32)
    xb, _, _ = _inputs(33, seed=7, dtype=torch.bfloat16)
    kw = dict(window=5, block=4, capacity=2, rule="recency")
    o32, _ = _run(x32, wk.float(), cw.float(), **kw)
    ob, _ = _run(xb, wk.float(), cw.float(), **kw)
    assert ob.dtype == torch.bfloat16
    torch.testing.assert_close(ob.float(), o32, rtol=0.05, atol=0.05)


def test_bounded_state():
    x, wk, cw = _inputs(200, seed=8, dtype=torch.float32)
    _, s_short = _run({n: t[:, :, :60] for n, t in x.items()}, wk.float(), cw.float(), window=8, block=4, capacity=4)
    _, s_long = _run(x, wk.float(), cw.float(), window=8, block=4, capacity=4)
    assert s_long.nbytes <= s_short.nbytes + 4 * 4 * B * HKV * D * 3  # the window buffer varies by < one block
    assert s_long.keys.shape[2] <= 8 + 4 - 1


def test_bad_arguments():
    x, wk, cw = _inputs(8)
    with pytest.raises(ValueError, match="rule"):
        tiered_attention(**x, feature_key_weight=wk, count_weight=cw, window=4, block=2, capacity=2, rule="h2o")
    with pytest.raises(ValueError, match="window"):
        tiered_attention(**x, feature_key_weight=wk, count_weight=cw, window=0, block=2, capacity=2)
    with pytest.raises(ValueError, match="retrieve_score"):
        tiered_attention(**x, feature_key_weight=wk, count_weight=cw, window=4, block=2, capacity=0, retrieve=1,
                         retrieve_score="mean")
    with pytest.raises(ValueError, match="capacity must be 0"):
        tiered_attention(**x, feature_key_weight=wk, count_weight=cw, window=4, block=2, capacity=2, retrieve=1)


# block retrieval: every settled block stored, each query reading its best blocks exactly


@pytest.mark.parametrize("score", ["max", "bound"])
@pytest.mark.parametrize("retrieve", [1, 3, 50])
def test_retrieval_prefill_equals_the_definition(retrieve, score):
    x, wk, cw = _inputs(43, seed=9)
    valid = torch.ones(B, 43, dtype=torch.bool)
    valid[1, :5] = False
    kw = dict(window=6, block=4, capacity=0, retrieve=retrieve, retrieve_score=score, sink_distance=12,
              inv_freq=INV_FREQ, softcap=20.0)
    out, state = _run(x, wk, cw, sinks_n=2, valid=valid, **kw)
    ref = tiered_attention_reference(**x, feature_key_weight=wk, count_weight=cw, num_sinks=2, key_padding_mask=valid,
                                     **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert state.store_keys.shape[2] == state.frontier == settle_frontier(42, 6, 4)
    assert state.store_lo.shape[2] == state.frontier // 4 and int(state.count.max()) > 0
    assert not bool(state.store_valid[1, :5].any())  # padding is stored as nothing


@pytest.mark.parametrize("score", ["max", "bound"])
@pytest.mark.parametrize("steps", [[1] * 43, [20, 1, 1, 21]])
def test_retrieval_decoding_equals_the_prefill(steps, score):
    x, wk, cw = _inputs(43, seed=10)
    kw = dict(window=6, block=4, capacity=0, retrieve=2, retrieve_score=score)
    full, s_full = _run(x, wk, cw, sinks_n=1, **kw)
    split, s_split = _run(x, wk, cw, steps=steps, sinks_n=1, **kw)
    torch.testing.assert_close(split, full, rtol=1e-10, atol=1e-10)
    assert torch.equal(s_split.store_keys, s_full.store_keys) and torch.equal(s_split.store_lo, s_full.store_lo)


def test_retrieval_finds_the_block_that_answers_the_query():
    """A key planted far beyond the window, aligned with the last query, is read exactly and wins."""
    T, C = 64, 4
    x, wk, cw = _inputs(T, seed=11)
    x["mq"][:, :, -1] = 0
    x["mq"][:, :, -1, 0] = 4.0
    x["mk"][:, :, 9] = 0
    x["mk"][:, :, 9, 0] = 8.0  # block 2 of the store, 50 tokens before the query
    x["v"][:, :, 9] = 5.0
    kw = dict(window=8, block=C, capacity=0)
    plain, _ = _run(x, wk, cw, retrieve=0, **kw)
    for score in ("max", "bound"):
        found, _ = _run(x, wk, cw, retrieve=1, retrieve_score=score, **kw)
        assert (found[:, :, -1] - 5.0).abs().max() < 0.1
    assert (plain[:, :, -1] - 5.0).abs().max() > 1.0  # the read alone does not recover it
    ref = tiered_attention_reference(**x, feature_key_weight=wk, count_weight=cw, retrieve=1, retrieve_score="bound", **kw)
    torch.testing.assert_close(found, ref, rtol=1e-10, atol=1e-10)


def test_retrieval_in_fp32_follows_fp64():
    x64, wk, cw = _inputs(50, seed=12, big=10.0)
    x32 = {n: t.float() for n, t in x64.items()}
    kw = dict(window=6, block=4, capacity=0, retrieve=2)
    o64, _ = _run(x64, wk, cw, **kw)
    o32, _ = _run(x32, wk.float(), cw.float(), **kw)
    assert torch.isfinite(o32).all()
    torch.testing.assert_close(o32.double(), o64, rtol=1e-4, atol=1e-4)


def test_retrieval_ties_go_to_the_older_block():
    from retrofit.ops.exact_tier import _top_blocks

    bound = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, float("-inf")]])
    assert _top_blocks(bound, 1).nonzero()[:, 1].tolist() == [1]
    assert _top_blocks(bound, 3).nonzero()[:, 1].tolist() == [1, 2, 3]
    assert _top_blocks(bound, 4).nonzero()[:, 1].tolist() == [1, 2, 3, 4]
    assert _top_blocks(bound, 7).all()


def test_retrieval_in_segments_longer_than_its_query_groups_equals_decoding():
    """Segments of 32 queries run in groups of RETRIEVAL_QUERIES: the same outputs as one token at a time."""
    x, wk, cw = _inputs(110, seed=13)
    kw = dict(window=8, block=32, capacity=0, retrieve=1, retrieve_score="bound")
    full, _ = _run(x, wk, cw, sinks_n=1, **kw)
    split, _ = _run(x, wk, cw, steps=[1] * 110, sinks_n=1, **kw)
    torch.testing.assert_close(split, full, rtol=1e-10, atol=1e-10)


def test_a_store_continued_twice_from_one_state_keeps_both_continuations_apart():
    """The store grows in place for the newest state only: continuing an older state copies it."""
    x, wk, cw = _inputs(43, seed=14)
    y, _, _ = _inputs(43, seed=15)
    kw = dict(window=6, block=4, capacity=0, retrieve=2, feature_key_weight=wk, count_weight=cw)
    first = {n: t[:, :, :20] for n, t in x.items()}
    _, state = tiered_attention(**first, **kw)
    rest = lambda src: {n: t[:, :, 20:] for n, t in src.items()}  # noqa: E731
    out_x, s_x = tiered_attention(**rest(x), state=state, **kw)
    out_y, s_y = tiered_attention(**rest(y), state=state, **kw)  # from the same, older state
    full_x, f_x = tiered_attention(**x, **kw)
    torch.testing.assert_close(out_x, full_x[:, :, 20:], rtol=1e-10, atol=1e-10)
    assert torch.equal(s_x.store_keys, f_x.store_keys) and torch.equal(s_x.store_values, f_x.store_values)
    assert not torch.equal(s_y.store_keys, s_x.store_keys)
    assert s_x.nbytes >= sum(t.numel() * t.element_size() for t in (s_x.store_keys, s_x.store_values))


@pytest.mark.parametrize("score", ["max", "bound"])
def test_retrieval_backward_equals_the_definition(score):
    x, wk, cw = _inputs(22, seed=16)
    kw = dict(window=4, block=2, capacity=0, retrieve=2, retrieve_score=score, softcap=20.0)
    grads = []
    for fn in (lambda a: _run(a, wk, cw, sinks_n=1, **kw)[0],
               lambda a: tiered_attention_reference(**a, feature_key_weight=wk, count_weight=cw, num_sinks=1, **kw)):
        leaves = {n: t.clone().requires_grad_(n in ("q", "k", "v", "mq", "mk")) for n, t in x.items()}
        (fn(leaves) * torch.linspace(-1, 1, 8, dtype=torch.float64)).sum().backward()
        grads.append([leaves[n].grad for n in ("q", "k", "v", "mq", "mk")])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_tier_backward_equals_the_definition(softcap):
    # every part of the exact softmax (window, sinks past their distance, tier) and the read, with padding
    x, wk, cw = _inputs(26, seed=17, big=3.0)
    valid = torch.ones(B, 26, dtype=torch.bool)
    valid[1, :3] = False
    kw = dict(window=5, block=3, capacity=3, rule="recall", softcap=softcap, sink_distance=6, inv_freq=INV_FREQ)
    grads = []
    for fn in (lambda a: _run(a, wk, cw, sinks_n=2, valid=valid, **kw)[0],
               lambda a: tiered_attention_reference(**a, feature_key_weight=wk, count_weight=cw, num_sinks=2,
                                                    key_padding_mask=valid, **kw)):
        leaves = {n: t.clone().requires_grad_(n in ("q", "k", "v", "mq", "mk", "fq", "scale")) for n, t in x.items()}
        (fn(leaves) * torch.linspace(-1, 1, 8, dtype=torch.float64)).sum().backward()
        grads.append([leaves[n].grad for n in ("q", "k", "v", "mq", "mk", "fq", "scale")])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)
