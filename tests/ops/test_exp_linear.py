"""exp(Q)exp(K) linear attention: chunked and recurrent forms against the materialised reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from retrofit.ops import LatteState, exp_linear_attention, exp_linear_attention_reference, exp_linear_attention_step
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
