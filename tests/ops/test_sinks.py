"""Sliding window + attention sinks: the LSE-merged form against the dense reference."""
from __future__ import annotations

import pytest
import torch

import retrofit.ops.sinks as sinks_mod
from retrofit.ops.sinks import first_valid, sink_window_attention, sink_window_attention_reference
from retrofit.ops.sliding_window import sliding_window_attention_reference, sliding_window_lse
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import attention_inputs, padding_mask


def _inputs(B=2, Hq=4, Hkv=2, T=37, d=8, dtype=torch.float64, seed=0, scale=1.0):
    return attention_inputs(B, Hq, Hkv, T, T, d, dtype=dtype, seed=seed, scale=scale)


def _padding(B, T, left=(0, 5)):
    return padding_mask(B, T, list(left))


def _whole(q, k, v, window, sinks, mask=None, softcap=None):
    B, _, T, _ = q.shape
    valid = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    idx = torch.arange(T).expand(B, T)
    sidx, svalid, sk, sv = first_valid(sinks, idx, valid, k, v)
    return sink_window_attention(q, k, v, window, sk, sv, sidx, svalid, softcap=softcap, key_padding_mask=mask)


@pytest.mark.parametrize("window", [1, 4, 9, 40])
@pytest.mark.parametrize("sinks", [1, 4])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_forward_matches_dense_reference(window, sinks, padded, softcap, path):
    q, k, v = _inputs()
    mask = _padding(2, q.shape[2]) if padded else None
    ref = sink_window_attention_reference(q, k, v, window, sinks, softcap=softcap, key_padding_mask=mask)
    got = _whole(q, k, v, window, sinks, mask, softcap)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


def test_without_reachable_sinks_it_is_the_window_attention():
    q, k, v = _inputs()
    ref = sliding_window_attention_reference(q, k, v, 64)  # window covers every query: sinks always inside
    torch.testing.assert_close(_whole(q, k, v, 64, 4), ref, atol=1e-12, rtol=1e-12)


def test_lse_matches_dense_logsumexp():
    q, k, _ = _inputs(T=29)
    mask = _padding(2, 29)
    for window in (1, 5, 29, 50):
        got = sliding_window_lse(q, k, window, scaling=0.3, key_padding_mask=mask)
        s = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
        t = torch.arange(29)
        allowed = (t[None] <= t[:, None]) & (t[None] > t[:, None] - window)
        allowed = allowed[None, None] & mask[:, None, None, :]
        ref = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
        real = mask[:, None, :].expand_as(ref)
        torch.testing.assert_close(got[real], ref[real], atol=1e-12, rtol=1e-12)


@pytest.fixture(params=["merged", "one-softmax"])
def path(request, monkeypatch):
    """Both forms of sink_window_attention: the window kernel + LSE merge, and the one dense softmax
    that calls with few queries (decoding) take."""
    monkeypatch.setattr(sinks_mod, "FUSED_MAX_QUERIES", 0 if request.param == "merged" else 10**9)
    return request.param


def test_gradcheck_float64(path):
    q, k, v = _inputs(B=1, Hq=2, Hkv=1, T=13, d=4)
    mask = torch.ones(1, 13, dtype=torch.bool)
    mask[0, :2] = False
    tensors = [t.clone().requires_grad_() for t in (q, k, v)]

    def f(q, k, v):
        return _whole(q, k, v, 4, 2, mask, softcap=2.0)

    assert torch.autograd.gradcheck(f, tensors, atol=1e-7)


def _one_softmax_by_definition(q, k, v, window, sink_k, sink_v, sink_idx, sink_valid, q_start, num_past, scaling,
                               softcap, mask, far=None):
    """One softmax per query over the concatenated ``[sinks; cached and new keys]``, every score dense:
    query i (key index ``num_past + i``, stream index ``q_start + i``) sees the real keys of its window
    and the valid sinks that lie before the window; with ``far = (far_q, far_k, distance)`` a sink more
    than ``distance`` before the query is scored ``far_q . far_k``. Padded queries output 0."""
    B, Hq, Tq, _ = q.shape
    group = Hq // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sk, sv = sink_k.repeat_interleave(group, 1), sink_v.repeat_interleave(group, 1)
    i = torch.arange(Tq)[:, None] + num_past
    j = torch.arange(k.shape[2])[None, :]
    keys_ok = ((j <= i) & (j > i - window))[None] & mask[:, None, :]  # (B, Tq, Tk)
    t = (torch.arange(Tq) + q_start)[None, :, None]
    sinks_ok = sink_valid[:, None, :] & (sink_idx[:, None, :] <= t - window)  # (B, Tq, n)
    sink_scores = q @ sk.transpose(-1, -2)
    if far is not None:
        far_q, far_k, distance = far
        far_scores = far_q @ far_k.repeat_interleave(group, 1).transpose(-1, -2)
        sink_scores = torch.where((t - sink_idx[:, None, :] > distance)[:, None], far_scores, sink_scores)
    scores = torch.cat([sink_scores, q @ kk.transpose(-1, -2)], -1) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    q_ok = mask[:, num_past:]
    allowed = torch.cat([sinks_ok, keys_ok], -1) | (~q_ok[:, :, None] & (torch.arange(scores.shape[-1]) == 0))
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
    return (probs @ torch.cat([sv, vv], 2)) * q_ok[:, None, :, None]


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("capped", [False, True])
def test_values_and_gradients_of_every_input_match_the_definition(softcap, capped, path):
    """200 queries after 24 cached keys (more than the window: the kernel drops some), GQA, left padding
    in the cache and beyond, an invalid sink slot, score spreads of ~100 nats, and with ``capped`` the
    far-sink scores: values and the gradients of q, k, v, the sink keys and values (and the far
    queries and keys) against autograd through one dense softmax per query."""
    B, Hq, Hkv, Tq, d, window, num_past, q_start = 2, 4, 2, 200, 6, 16, 24, 60
    q, k, v = attention_inputs(B, Hq, Hkv, Tq, num_past + Tq, d, seed=1, scale=3.0)
    sink_k, sink_v = (x[:, :, :3] * 1.5 for x in attention_inputs(B, Hq, Hkv, 3, 3, d, seed=2, scale=3.0)[1:])
    sink_idx = torch.tensor([[0, 1, 2], [7, 9, 15]])
    sink_valid = torch.tensor([[True, True, True], [True, True, False]])
    mask = padding_mask(B, num_past + Tq, [0, 50])
    far_inputs = attention_inputs(B, Hq, Hkv, Tq, 3, d, seed=3, scale=3.0)[:2] if capped else ()
    distance = 90
    kw = dict(q_start=q_start, num_past=num_past, scaling=0.4, softcap=softcap)

    def op(q, k, v, sink_k, sink_v, *far):
        return sink_window_attention(q, k, v, window, sink_k, sink_v, sink_idx, sink_valid, key_padding_mask=mask,
                                     far=sinks_mod.FarSinks(*far, distance) if far else None, **kw)

    def reference(q, k, v, sink_k, sink_v, *far):
        return _one_softmax_by_definition(q, k, v, window, sink_k, sink_v, sink_idx, sink_valid, mask=mask,
                                          far=(*far, distance) if far else None, **kw)

    assert_values_and_grads_match(op, reference, (q, k, v, sink_k, sink_v, *far_inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_long_sequence_forward_and_backward(dtype, path):
    """Logit spreads of 100+: finite, and no further from the float64 truth than the dense form in the same dtype."""
    q, k, v = _inputs(B=1, Hq=4, Hkv=1, T=700, d=16, dtype=torch.float32, scale=4.0)

    def run(fn, dt):
        ts = [t.to(dt).clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ts)
        out.double().pow(2).sum().backward()
        return [out.detach().double()] + [t.grad.double() for t in ts]

    fast = lambda q, k, v: _whole(q, k, v, 128, 4)  # noqa: E731
    dense = lambda q, k, v: sink_window_attention_reference(q, k, v, 128, 4)  # noqa: E731
    truth, got, ref = run(dense, torch.float64), run(fast, dtype), run(dense, dtype)
    for t, a, b in zip(truth, got, ref):
        assert torch.isfinite(a).all()
        err, ref_err = (a - t).abs().max(), (b - t).abs().max()
        assert err <= 2 * ref_err + 1e-4 * t.abs().max(), (err, ref_err)


def test_chunked_calls_with_carried_sinks_equal_one_call(path):
    """What decoding does: keys beyond the window are dropped, the sinks are kept apart."""
    q, k, v = _inputs(T=50)
    mask = _padding(2, 50, left=(0, 7))
    window, sinks = 6, 2
    ref = sink_window_attention_reference(q, k, v, window, sinks, key_padding_mask=mask)
    outs, seen = [], 0
    sidx = svalid = sk = sv = None
    for chunk in (9, 1, 1, 20, 19):
        lo, hi = seen, seen + chunk
        past = max(0, lo - (window - 1))
        idx = torch.arange(lo, hi).expand(2, -1)
        cand = [idx, mask[:, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi]]
        if sk is not None:
            cand = [torch.cat([a, b], dim=-1 if a.dim() == 2 else 2) for a, b in zip([sidx, svalid, sk, sv], cand)]
        sidx, svalid, sk, sv = first_valid(sinks, *cand)
        out = sink_window_attention(q[:, :, lo:hi], k[:, :, past:hi], v[:, :, past:hi], window, sk, sv, sidx, svalid,
                                    q_start=lo, key_padding_mask=mask[:, past:hi], num_past=lo - past)
        outs.append(out)
        seen = hi
    torch.testing.assert_close(torch.cat(outs, dim=2), ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("num_past", [0, 3, 7])
@pytest.mark.parametrize("T", [1, 5, 12, 29])
def test_lse_short_and_long_query_blocks_agree_with_dense(num_past, T):
    """Query blocks no longer than the window take the dense path, longer ones the blocked layout;
    both equal the dense log-sum-exp, with cached keys in front (decoding / chunked prefill)."""
    window = 8
    q, k, _ = _inputs(T=T)
    past = _inputs(T=max(num_past, 1), seed=5)[1][:, :, :num_past]
    keys = torch.cat([past, k], dim=2)
    mask = torch.ones(2, num_past + T, dtype=torch.bool)
    mask[1, : min(2, num_past + T - 1)] = False
    got = sliding_window_lse(q, keys, window, scaling=0.3, softcap=2.0, key_padding_mask=mask, num_past=num_past)
    s = torch.matmul(q, keys.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    s = torch.tanh(s / 2.0) * 2.0
    tq = torch.arange(T)[:, None] + num_past
    tk = torch.arange(num_past + T)[None]
    allowed = ((tk <= tq) & (tk > tq - window))[None, None] & mask[:, None, None, :]
    ref = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
    real = mask[:, None, num_past:].expand_as(ref)
    assert got.shape == (2, q.shape[1], T)
    torch.testing.assert_close(got[real], ref[real], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_steps_one_softmax_equals_the_merge_forward_and_backward(dtype, monkeypatch):
    """Single-token steps with far more past keys than the window (dropped), left padding, softcap,
    logits of spread 50+: the one-softmax form and the merged form agree, values and gradients."""
    B, window, n, past = 2, 16, 3, 40
    q, k, v = _inputs(B=B, Hq=4, Hkv=2, T=past + 1, d=8, dtype=torch.float32, seed=3, scale=3.0)
    mask = _padding(B, past + 1, left=(0, 9))
    sidx, svalid, sk, sv = first_valid(n, torch.arange(past).expand(B, -1), mask[:, :past], k[:, :, :past], v[:, :, :past])

    def run(limit):
        monkeypatch.setattr(sinks_mod, "FUSED_MAX_QUERIES", limit)
        ts = [t.to(dtype).clone().requires_grad_() for t in (q[:, :, past:], k, v, sk, sv)]
        out = sink_window_attention(ts[0], ts[1], ts[2], window, ts[3], ts[4], sidx, svalid, q_start=past,
                                    softcap=20.0, key_padding_mask=mask, num_past=past)
        out.float().pow(2).sum().backward()
        return [out.detach().float()] + [t.grad.float() for t in ts]

    merged, fused = run(0), run(10**9)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for a, b in zip(fused, merged):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tol)


# ----------------------------------------------------------------- capped sink distance
INV_FREQ = 1.0 / (100.0 ** (torch.arange(0, 8, 2).double() / 8))


def _rotated_whole(q_raw, k_raw, v, window, sinks, distance, mask=None, softcap=None, q_start=0):
    """The fast form on RoPE'd q / k with the far sink pairs capped at ``distance``."""
    from retrofit.ops.rope import rope_rotate
    from retrofit.ops.sinks import capped_sinks

    B, _, T, _ = q_raw.shape
    pos = torch.arange(T)
    q, k = rope_rotate(q_raw, pos, INV_FREQ), rope_rotate(k_raw, pos, INV_FREQ)
    valid = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    sidx, svalid, sk, sv = first_valid(sinks, pos.expand(B, T), valid, k, v)
    far = capped_sinks(q, sk, sidx, 0, distance, INV_FREQ)
    return sink_window_attention(q, k, v, window, sk, sv, sidx, svalid, softcap=softcap, key_padding_mask=mask, far=far)


@pytest.mark.parametrize("distance", [0, 3, 11, 36])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_capped_distance_matches_dense_reference(distance, padded, softcap, path):
    """Sink pairs farther apart than the cap are scored exactly at the cap; the dense reference
    rotates the raw q to the cap itself (no re-rotation), so the two forms share no code path."""
    q, k, v = _inputs(T=37)
    mask = _padding(2, 37) if padded else None
    ref = sink_window_attention_reference(q, k, v, 4, 3, softcap=softcap, key_padding_mask=mask, rope=(INV_FREQ, distance))
    got = _rotated_whole(q, k, v, 4, 3, distance, mask, softcap)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


def test_cap_beyond_the_sequence_changes_nothing_and_a_small_cap_does():
    from retrofit.ops.rope import rope_rotate

    q, k, v = _inputs(T=37)
    pos = torch.arange(37)
    plain = sink_window_attention_reference(rope_rotate(q, pos, INV_FREQ), rope_rotate(k, pos, INV_FREQ), v, 4, 3)
    torch.testing.assert_close(_rotated_whole(q, k, v, 4, 3, 36), plain, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(_rotated_whole(q, k, v, 4, 3, 5), plain, atol=1e-6)


def test_capped_gradcheck_float64():
    q, k, v = _inputs(B=1, Hq=2, Hkv=1, T=13, d=8)
    mask = torch.ones(1, 13, dtype=torch.bool)
    mask[0, :2] = False
    tensors = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda q, k, v: _rotated_whole(q, k, v, 3, 2, 4, mask, softcap=2.0), tensors, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capped_large_logits_forward_and_backward(dtype):
    """Logit spreads of 100+ with the cap active on most pairs: finite, and as close to the float64
    truth as the dense reference in the same dtype."""
    q, k, v = _inputs(B=1, Hq=4, Hkv=1, T=300, d=8, dtype=torch.float32, scale=6.0)

    def run(fn, dt):
        ts = [t.to(dt).clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ts)
        out.double().pow(2).sum().backward()
        return [out.detach().double()] + [t.grad.double() for t in ts]

    fast = lambda q, k, v: _rotated_whole(q, k, v, 32, 4, 40)  # noqa: E731
    dense = lambda q, k, v: sink_window_attention_reference(q, k, v, 32, 4, rope=(INV_FREQ, 40))  # noqa: E731
    truth, got, ref = run(dense, torch.float64), run(fast, dtype), run(dense, dtype)
    for t, a, b in zip(truth, got, ref):
        assert torch.isfinite(a).all()
        err, ref_err = (a - t).abs().max(), (b - t).abs().max()
        assert err <= 2 * ref_err + 1e-4 * t.abs().max(), (err, ref_err)


def test_capped_sink_keys_give_one_query_the_capped_scores():
    """The decoding form (sink keys moved to t - distance) scores as the FarSinks form does."""
    from retrofit.ops.rope import rope_rotate
    from retrofit.ops.sinks import capped_sink_keys, capped_sinks

    q, k, _ = _inputs(B=2, T=1, seed=4)
    sk = _inputs(B=2, T=3, seed=5)[1]
    sidx = torch.tensor([[0, 1, 2], [5, 6, 9]])
    t, distance = 30, 22
    q_t = rope_rotate(q, torch.tensor([t]), INV_FREQ)
    sk_rot = rope_rotate(sk, sidx[:, None, :], INV_FREQ)
    moved = capped_sink_keys(sk_rot, sidx, t, distance, INV_FREQ)
    far = capped_sinks(q_t, sk_rot, sidx, t, distance, INV_FREQ)
    grp = q_t.reshape(2, 2, 2, 8)  # (B, Hkv, group * Tq, d)
    via_keys = torch.matmul(grp, moved.transpose(-1, -2))
    via_far = torch.matmul(far.q.reshape(2, 2, 2, 8), far.k.transpose(-1, -2))
    plain = torch.matmul(grp, sk_rot.transpose(-1, -2))
    is_far = (t - sidx) > distance  # (B, n): row 1's sink at 9 is within the cap
    torch.testing.assert_close(via_keys, torch.where(is_far[:, None, None], via_far, plain))


@pytest.mark.parametrize("T", [9, 37])  # 9: the one dense softmax of few queries; 37: the window kernel + merge
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_with_lse_returns_the_log_sum_exp_over_window_and_sinks(T, softcap):
    """``with_lse``: the same output, and the log-sum-exp of each query's scores over its window keys
    and the sinks before its window, against the scores written densely (left padding)."""
    q, k, v = _inputs(T=T)
    window, n = 4, 2
    mask = _padding(2, T, (0, 3))
    idx = torch.arange(T).expand(2, T)
    sidx, svalid, sk, sv = first_valid(n, idx, mask, k, v)
    out, lse = sink_window_attention(q, k, v, window, sk, sv, sidx, svalid, softcap=softcap, key_padding_mask=mask,
                                     with_lse=True)
    torch.testing.assert_close(out, _whole(q, k, v, window, n, mask, softcap), atol=1e-12, rtol=1e-12)
    s = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    rank = mask.long().cumsum(1) - 1
    allowed = (j <= t) & mask[:, None, :] & ((j > t - window) | (rank[:, None, :] < n))
    want = s.masked_fill(~allowed[:, None], float("-inf")).logsumexp(-1)
    real = mask[:, None, :].expand_as(want)
    torch.testing.assert_close(lse[real], want[real], atol=1e-10, rtol=1e-10)
