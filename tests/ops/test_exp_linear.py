"""exp(Q)exp(K) linear attention: chunked and recurrent forms against the materialised reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from retrofit.ops import LatteState, exp_linear_attention, exp_linear_attention_reference, exp_linear_attention_step
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import padding_mask


def _qkv(B, H, T, d, D, scale=2.0, dtype=torch.float64):
    return (torch.randn(B, H, T, d, dtype=dtype) * scale, torch.randn(B, H, T, d, dtype=dtype) * scale, torch.randn(B, H, T, D, dtype=dtype))


def test_reference_is_the_blog_formula():
    q, k, v = _qkv(1, 1, 6, 3, 2)
    w = torch.exp(q[0, 0]) @ torch.exp(k[0, 0]).T  # (t, s)
    w = w.tril()
    expected = (w @ v[0, 0]) / w.sum(-1, keepdim=True)
    torch.testing.assert_close(exp_linear_attention_reference(q, k, v)[0, 0], expected)


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 50), d=st.integers(1, 8), chunk=st.sampled_from([1, 4, 16, 32]), pad=st.integers(0, 6))
def test_chunked_matches_reference(T, d, chunk, pad):
    q, k, v = _qkv(2, 2, T, d, 3)
    mask = padding_mask(2, T, [0, pad])
    ref = exp_linear_attention_reference(q, k, v, key_padding_mask=mask)
    out, _ = exp_linear_attention(q, k, v, chunk_size=chunk, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_recurrent_steps_and_split_prefill_match():
    T = 40
    q, k, v = _qkv(2, 2, T, 6, 4)
    mask = padding_mask(2, T, [0, 5])
    ref = exp_linear_attention_reference(q, k, v, key_padding_mask=mask)
    pre, state = exp_linear_attention(q[:, :, :15], k[:, :, :15], v[:, :, :15], key_padding_mask=mask[:, :15], output_final_state=True)
    outs = [pre]
    for t in range(15, T):
        o, state = exp_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, valid=mask[:, t])
        outs.append(o[:, :, None])
    torch.testing.assert_close(torch.cat(outs, 2), ref, atol=1e-10, rtol=1e-10)
    # from an empty state, token by token
    st = LatteState.empty(2, 2, 6, 4, dtype=torch.float64)
    outs = []
    for t in range(T):
        o, st = exp_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], st, valid=mask[:, t])
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 2), ref, atol=1e-10, rtol=1e-10)


def test_per_token_query_shift_cancels_and_large_keys_stay_finite():
    q, k, v = _qkv(1, 2, 100, 16, 8, dtype=torch.float32)
    out, _ = exp_linear_attention(q, k, v)
    shifted, _ = exp_linear_attention(q + torch.randn(1, 2, 100, 1) * 100, k, v)
    torch.testing.assert_close(shifted, out, atol=1e-5, rtol=1e-5)
    k_big = k * 40.0
    ref = exp_linear_attention_reference(q.double(), k_big.double(), v.double())
    out_big, _ = exp_linear_attention(q, k_big, v)
    assert torch.isfinite(out_big).all()
    torch.testing.assert_close(out_big.double(), ref, atol=1e-5, rtol=1e-5)


def test_bf16_within_tolerance():
    q, k, v = _qkv(1, 2, 120, 16, 8, dtype=torch.float32)
    ref = exp_linear_attention_reference(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double())
    out, _ = exp_linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_gradcheck():
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 9, 3, 2))
    mask = padding_mask(1, 9, [2])
    assert gradcheck(lambda a, b, c: exp_linear_attention(a, b, c, chunk_size=4, key_padding_mask=mask)[0], (q, k, v))


@pytest.mark.parametrize("chunk", [8, 32])
def test_gradients_match_reference_fp32(chunk):
    q, k, v = _qkv(1, 2, 90, 16, 8, dtype=torch.float32)
    g = torch.randn(1, 2, 90, 8)
    grads = []
    for fn in (lambda a, b, c: exp_linear_attention_reference(a.double(), b.double(), c.double()),
               lambda a, b, c: exp_linear_attention(a, b, c, chunk_size=chunk)[0]):
        args = [x.clone().requires_grad_() for x in (q, k, v)]
        (fn(*args).double() * g).sum().backward()
        grads.append([x.grad for x in args])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------
# the chunked linear-attention form (since 2026-11-23): fast path taken, agrees forward and backward


@pytest.fixture
def fallbacks(monkeypatch):
    """Counts calls that the chunked form hands to the log-space form."""
    import retrofit.ops.exp_linear as mod

    calls = []
    original = mod._exp_linear_latte_form

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(mod, "_exp_linear_latte_form", spy)
    return calls


@pytest.mark.parametrize("T,chunk,pads", [(9, 4, [2]), (13, 8, [0, 5]), (16, 16, [3]), (5, 32, [1])])
def test_gradcheck_chunked_form_padding_and_ragged_chunks(T, chunk, pads, fallbacks):
    B = len(pads)
    q, k, v = (x.requires_grad_() for x in _qkv(B, 2, T, 3, 2))
    mask = padding_mask(B, T, pads)
    fn = lambda a, b, c: exp_linear_attention(a, b, c, chunk_size=chunk, key_padding_mask=mask)[0]  # noqa: E731
    assert gradcheck(fn, (q, k, v))
    torch.testing.assert_close(fn(q, k, v), exp_linear_attention_reference(q, k, v, key_padding_mask=mask), atol=1e-12, rtol=1e-10)
    assert fallbacks == []  # the chunked linear-attention form answered, not the log-space one


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_forward_and_gradients_with_padding_match_reference(dtype, tol, fallbacks):
    T, chunk = 150, 32  # 32 does not divide 150
    q, k, v = _qkv(2, 3, T, 16, 8, scale=1.5, dtype=torch.float32)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    mask = padding_mask(2, T, [0, 40])
    g = torch.randn(2, 3, T, 8)
    results = []
    for fn in (lambda a, b, c: exp_linear_attention_reference(a.double(), b.double(), c.double(), key_padding_mask=mask),
               lambda a, b, c: exp_linear_attention(a, b, c, chunk_size=chunk, key_padding_mask=mask)[0]):
        args = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*args)
        (out.double() * g).sum().backward()
        results.append([out.double()] + [x.grad.double() for x in args])
    assert results[1][0].dtype == torch.float64 and fallbacks == []
    for got, want in zip(results[1], results[0]):
        scale = want.abs().max().clamp_min(1.0)
        torch.testing.assert_close(got / scale, want / scale, atol=tol, rtol=tol)


@pytest.mark.parametrize("jump,fast", [(55.0, True), (300.0, False)])
def test_large_logit_spread_inside_a_chunk(jump, fast, fallbacks):
    """A key that exceeds every earlier key of its feature by `jump` nats in the middle of a
    chunk: up to MAX_QUERY_GAIN the chunked form handles it, beyond that the log-space form."""
    T = 200
    q, k, v = _qkv(1, 2, T, 16, 8, scale=1.0, dtype=torch.float32)
    k[:, :, 100, 3] += jump
    q[:, 1] *= 30.0  # query spreads of 100+ too
    ref = exp_linear_attention_reference(q.double(), k.double(), v.double())
    args = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = exp_linear_attention(*args, chunk_size=64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in args)
    assert (fallbacks == []) == fast


@pytest.mark.parametrize("form", ["chunked", "log-space", "continued state"])
def test_values_and_gradients_match_the_reference_in_float64(form, fallbacks):
    """Each form's values and q, k, v gradients over 260 tokens (padded rows, ragged last chunk)
    against autograd through the materialised reference: the chunked form; the log-space form that
    answers a key jumping 300 nats inside a chunk; and a prefill whose differentiable final state a
    second call continues (that state's path takes the log-space form too)."""
    T, chunk, split = 260, 64, 100
    q, k, v = _qkv(2, 2, T, 6, 4, scale=3.0)
    if form == "log-space":
        k[:, :, 150, 2] += 300.0
    mask = padding_mask(2, T, [0, 29])

    def op(q, k, v):
        if form != "continued state":
            return exp_linear_attention(q, k, v, chunk_size=chunk, key_padding_mask=mask)[0]
        sl = lambda x, a, b: x[:, :, a:b]  # noqa: E731
        first, state = exp_linear_attention(sl(q, 0, split), sl(k, 0, split), sl(v, 0, split), chunk_size=chunk,
                                            key_padding_mask=mask[:, :split], output_final_state=True)
        rest, _ = exp_linear_attention(sl(q, split, T), sl(k, split, T), sl(v, split, T), chunk_size=chunk,
                                       key_padding_mask=mask[:, split:], initial_state=state)
        return torch.cat([first, rest], dim=2)

    assert_values_and_grads_match(op, lambda q, k, v: exp_linear_attention_reference(q, k, v, key_padding_mask=mask), (q, k, v))
    assert (fallbacks == []) == (form == "chunked")


def test_steps_values_and_gradients_match_the_reference_in_float64():
    """The decoding step, looped over 120 padded tokens from an empty state: values and q, k, v
    gradients through the state against the materialised reference."""
    T = 120
    q, k, v = _qkv(2, 2, T, 5, 4, scale=3.0)
    mask = padding_mask(2, T, [0, 19])

    def steps(q, k, v):
        state, outs = LatteState.empty(2, 2, 5, 4, dtype=torch.float64), []
        for t in range(T):
            o, state = exp_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, valid=mask[:, t])
            outs.append(o)
        return torch.stack(outs, 2)

    assert_values_and_grads_match(steps, lambda q, k, v: exp_linear_attention_reference(q, k, v, key_padding_mask=mask), (q, k, v))


def test_query_shift_per_token_cancels_exactly_in_chunked_form(fallbacks):
    q, k, v = _qkv(1, 2, 70, 8, 4)
    out, _ = exp_linear_attention(q, k, v, chunk_size=16)
    shifted, _ = exp_linear_attention(q + torch.randn(1, 2, 70, 1, dtype=torch.float64) * 1000, k, v, chunk_size=16)
    torch.testing.assert_close(shifted, out, atol=1e-12, rtol=1e-10)
    assert fallbacks == []


def test_split_chunked_prefill_then_steps_equal_one_forward(fallbacks):
    """Prefill in two chunked calls (the second from the first's state), then decode: equals the
    reference on the whole sequence; the state carries the key shift."""
    T = 90
    q, k, v = _qkv(2, 2, T, 6, 4, scale=3.0)
    mask = padding_mask(2, T, [0, 20])
    ref = exp_linear_attention_reference(q, k, v, key_padding_mask=mask)
    sl = lambda x, a, b: x[:, :, a:b]  # noqa: E731
    o1, st1 = exp_linear_attention(sl(q, 0, 30), sl(k, 0, 30), sl(v, 0, 30), chunk_size=8, key_padding_mask=mask[:, :30], output_final_state=True)
    o2, st2 = exp_linear_attention(sl(q, 30, 80), sl(k, 30, 80), sl(v, 30, 80), chunk_size=16, key_padding_mask=mask[:, 30:80],
                                   initial_state=st1, output_final_state=True)
    outs = [o1, o2]
    for t in range(80, T):
        o, st2 = exp_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], st2, valid=mask[:, t])
        outs.append(o[:, :, None])
    torch.testing.assert_close(torch.cat(outs, 2), ref, atol=1e-10, rtol=1e-10)
    # the chunked final state is the recurrent one
    _, st_rec = exp_linear_attention(q, k, v, chunk_size=1000, key_padding_mask=mask, output_final_state=True)
    st_loop = LatteState.empty(2, 2, 6, 4, dtype=torch.float64)
    for t in range(T):
        _, st_loop = exp_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], st_loop, valid=mask[:, t])
    torch.testing.assert_close(st_rec.z, st_loop.z, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(st_rec.m, st_loop.m, atol=1e-10, rtol=1e-10)
    assert fallbacks == []


def test_differentiable_states_take_the_log_space_form(fallbacks):
    q, k, v = _qkv(1, 2, 12, 3, 2)
    init = LatteState(m=torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True),
                      z=torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True))
    assert gradcheck(lambda m, z: exp_linear_attention(q, k, v, chunk_size=4, initial_state=LatteState(m, z))[0], (init.m, init.z))
    assert len(fallbacks) > 0


def test_inputs_are_not_modified(fallbacks):
    q, k, v = _qkv(1, 2, 64, 8, 4)  # T a multiple of the chunk: the op sees views of the inputs
    before = [x.clone() for x in (q, k, v)]
    exp_linear_attention(q, k, v, chunk_size=16)
    for x, y in zip((q, k, v), before):
        assert torch.equal(x, y)
