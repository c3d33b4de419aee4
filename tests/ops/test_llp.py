"""LLP half-segment attention: blocked and cached forms against a per-query loop and the dense form."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from retrofit.ops.llp import LLPState, llp_attention, llp_attention_cached, llp_attention_reference
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import padding_mask


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _loop_reference(q, k, v, segment, scaling, softcap, mask):
    """Per-query evaluation of the definition over real-token ranks (independent of the ops)."""
    B, Hq, T, _ = q.shape
    group = Hq // k.shape[1]
    h = segment // 2
    out = torch.zeros(B, Hq, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        real = [s for s in range(T) if mask is None or mask[b, s]]
        rank = {s: i for i, s in enumerate(real)}
        for t in real:
            keys = [s for s in real if rank[s] <= rank[t] and rank[s] // h >= rank[t] // h - 1]
            for hh in range(Hq):
                scores = (k[b, hh // group, keys].double() @ q[b, hh, t].double()) * scaling
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                out[b, hh, t] = torch.softmax(scores, 0) @ v[b, hh // group, keys].double()
    return out


def _inputs(B, Hq, Hkv, T, d=4, dv=3, dtype=torch.float64, scale=2.0):
    return (
        torch.randn(B, Hq, T, d, dtype=dtype) * scale,
        torch.randn(B, Hkv, T, d, dtype=dtype) * scale,
        torch.randn(B, Hkv, T, dv, dtype=dtype),
    )


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 40),
    segment=st.sampled_from([2, 4, 6, 10, 16, 64]),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    softcap=st.sampled_from([None, 5.0]),
    pad=st.integers(0, 9),
    hole=st.booleans(),
)
def test_blocked_and_dense_match_loop(T, segment, heads, softcap, pad, hole):
    q, k, v = _inputs(2, *heads, T)
    mask = padding_mask(2, T, [0, pad])
    if hole and T > 3:
        mask[0, T // 2] = False  # padding in the middle: ranks skip it
    ref = _loop_reference(q, k, v, segment, 0.5, softcap, mask)
    out = llp_attention(q, k, v, segment, scaling=0.5, softcap=softcap, key_padding_mask=mask)
    dense = llp_attention_reference(q, k, v, segment, scaling=0.5, softcap=softcap, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(dense, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("T,segment", [(300, 64), (257, 128), (1000, 14), (100, 512)])
def test_blocked_matches_dense_long_fp32(T, segment):
    q, k, v = _inputs(1, 4, 2, T, d=16, dv=16, dtype=torch.float32, scale=1.0)
    mask = padding_mask(1, T, [5])
    out = llp_attention(q, k, v, segment, key_padding_mask=mask)
    ref = llp_attention_reference(q.double(), k.double(), v.double(), segment, key_padding_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_segment_covering_the_sequence_is_full_causal_attention():
    q, k, v = (torch.randn(2, 2, 50, 8) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(llp_attention(q, k, v, 100), sdpa, atol=1e-5, rtol=1e-5)
    # one half-segment further back is not visible: query 60 of a 64-token segment misses key 0
    q2, k2, v2 = (torch.randn(1, 1, 70, 8) for _ in range(3))
    v2[:, :, 0] += 100.0
    out = llp_attention(q2, k2, v2, 64)
    full = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    assert torch.allclose(out[:, :, :64], full[:, :, :64], atol=1e-5)
    assert not torch.allclose(out[:, :, 64:], full[:, :, 64:], atol=1e-2)


def test_left_padded_row_equals_the_row_alone():
    q, k, v = _inputs(1, 4, 2, 30, dtype=torch.float32)
    pad = 7
    qp, kp, vp = (torch.cat([torch.randn(1, x.shape[1], pad, x.shape[-1]), x], dim=2) for x in (q, k, v))
    mask = padding_mask(1, 30 + pad, [pad])
    alone = llp_attention(q, k, v, 8)
    padded = llp_attention(qp, kp, vp, 8, key_padding_mask=mask)
    torch.testing.assert_close(padded[:, :, pad:], alone, atol=1e-6, rtol=1e-6)
    assert padded[:, :, :pad].abs().max() == 0


def test_single_token():
    q, k, v = _inputs(2, 2, 1, 1)
    torch.testing.assert_close(llp_attention(q, k, v, 8), v.expand(2, 2, 1, 3))


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_gradcheck(softcap):
    q, k, v = (x.requires_grad_() for x in _inputs(2, 2, 1, 13, d=3, dv=2, scale=1.0))
    mask = padding_mask(2, 13, [0, 3])
    assert gradcheck(lambda a, b, c: llp_attention(a, b, c, 6, softcap=softcap, key_padding_mask=mask), (q, k, v))


def test_gradients_blocked_vs_dense_fp32():
    q, k, v = _inputs(2, 4, 2, 150, d=16, dv=16, dtype=torch.float32, scale=1.0)
    g = torch.randn(2, 4, 150, 16)
    mask = padding_mask(2, 150, [0, 11])
    grads = []
    for fn in (llp_attention, llp_attention_reference):
        args = [x.clone().requires_grad_() for x in (q, k, v)]
        (fn(*args, 40, key_padding_mask=mask) * g).sum().backward()
        grads.append([x.grad for x in args])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("segment", [16, 40])
def test_values_and_gradients_match_dense_float64(softcap, segment):
    """300 tokens, GQA, a left-padded row and a hole of padding mid-row (ranks skip it), score spreads
    of ~100 nats: values and q, k, v gradients against autograd through the dense rank-masked form."""
    q, k, v = _inputs(2, 4, 2, 300, d=6, dv=5, scale=4.0)
    mask = padding_mask(2, 300, [0, 23])
    mask[0, 100:109] = False
    kw = dict(scaling=0.5, softcap=softcap, key_padding_mask=mask)
    assert_values_and_grads_match(
        lambda a, b, c: llp_attention(a, b, c, segment, **kw),
        lambda a, b, c: llp_attention_reference(a, b, c, segment, **kw),
        (q, k, v),
    )


def test_cached_values_and_gradients_match_dense_float64():
    """A 70-token prefill, a 13-token chunk, then single tokens through the cached form (GQA, padding,
    soft-capping): values and q, k, v gradients, through the cached keys, against the dense form."""
    T, segment = 100, 16
    q, k, v = _inputs(2, 4, 2, T, d=6, dv=5, scale=3.0)
    mask = padding_mask(2, T, [0, 23])
    kw = dict(scaling=0.5, softcap=8.0)

    def cached(q, k, v):
        state, outs = None, []
        for a, b in [(0, 70), (70, 83)] + [(t, t + 1) for t in range(83, T)]:
            o, state = llp_attention_cached(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], segment, state,
                                            key_padding_mask=mask[:, a:b], **kw)
            outs.append(o)
        return torch.cat(outs, 2)

    assert_values_and_grads_match(cached, lambda q, k, v: llp_attention_reference(q, k, v, segment, key_padding_mask=mask, **kw),
                                  (q, k, v))


def test_bf16_within_tolerance():
    q, k, v = _inputs(1, 4, 2, 300, d=16, dv=16, dtype=torch.float32, scale=1.0)
    args = [x.bfloat16() for x in (q, k, v)]
    out = llp_attention(*args, 64, softcap=30.0)
    ref = llp_attention_reference(*[x.double() for x in args], 64, softcap=30.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("segment", [2, 8, 20])
@pytest.mark.parametrize("prefill", [0, 1, 13, 30])
def test_cached_decoding_equals_full_forward(segment, prefill):
    T = 41
    q, k, v = _inputs(3, 4, 2, T, dtype=torch.float32, scale=1.0)
    mask = padding_mask(3, T, [0, 5, 9])
    full = llp_attention(q, k, v, segment, softcap=20.0, key_padding_mask=mask)
    state, outs = None, []
    if prefill:
        o, state = llp_attention_cached(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], segment, state, softcap=20.0, key_padding_mask=mask[:, :prefill])
        outs.append(o)
    for t in range(prefill, T):
        o, state = llp_attention_cached(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], segment, state, softcap=20.0, key_padding_mask=mask[:, t : t + 1])
        outs.append(o)
        # only the previous and the current half-segment are kept (plus columns of padding)
        assert state.length <= segment - 1 + 9
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)
    assert state.seen.tolist() == [41, 36, 32]


def test_cached_state_is_bounded_and_chunks_compose():
    q, k, v = _inputs(1, 2, 2, 200, dtype=torch.float32, scale=1.0)
    full = llp_attention(q, k, v, 16)
    state, outs = LLPState.empty(1, 2, 4, 3), []
    for a in range(0, 200, 7):
        o, state = llp_attention_cached(q[:, :, a : a + 7], k[:, :, a : a + 7], v[:, :, a : a + 7], 16, state)
        outs.append(o)
        assert state.length <= 15
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)
    # next query has rank 200 in half-segment 25: it may see half-segment 24 = ranks 192..199 only
    assert state.rank[0].tolist() == list(range(192, 200))


def test_bad_segment():
    q, k, v = _inputs(1, 1, 1, 4)
    with pytest.raises(ValueError, match="even"):
        llp_attention(q, k, v, 5)
    with pytest.raises(ValueError, match="as many keys"):
        llp_attention(q, k[:, :, :3], v[:, :, :3], 4)
