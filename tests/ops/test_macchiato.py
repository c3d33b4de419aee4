"""Latte Macchiato mixing (Definition 3): SWA state 0 + latent states, against dense references."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from retrofit.ops import macchiato_attention, macchiato_attention_reference, sliding_window_attention
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import padding_mask


def _inputs(B=2, Hq=4, Hkv=2, T=90, d=8, L=5, dtype=torch.float64):
    q = torch.randn(B, Hq, T, d, dtype=dtype)
    k = torch.randn(B, Hkv, T, d, dtype=dtype)
    v = torch.randn(B, Hkv, T, d, dtype=dtype)
    mix = torch.randn(B, Hq, T, L + 1, dtype=dtype) * 2
    lat = torch.randn(B, Hq, T, L, dtype=dtype) * 3
    return q, k, v, mix, lat


def test_matches_reference_with_gqa_softcap_padding():
    q, k, v, mix, lat = _inputs()
    mask = padding_mask(2, 90, [0, 13])
    kw = dict(window=16, scaling=0.3, softcap=20.0, key_padding_mask=mask)
    out, state = macchiato_attention(q, k, v, mix, lat, chunk_size=32, output_final_state=True, **kw)
    ref = macchiato_attention_reference(q, k, v, mix, lat, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert state.m.shape == (2, 4, 5, 8)


def test_closed_latent_path_is_exactly_sliding_window():
    q, k, v, mix, lat = _inputs(dtype=torch.float32)
    mix[..., 0] = 1e4  # p(l>0|t) = exp(-1e4) underflows to exactly 0 in fp32
    out, _ = macchiato_attention(q, k, v, mix, lat, window=16)
    swa = sliding_window_attention(q, k, v, 16)
    torch.testing.assert_close(out, swa, atol=0, rtol=0)


def test_gradcheck():
    q, k, v, mix, lat = (x.requires_grad_() for x in _inputs(B=1, Hq=2, Hkv=1, T=11, d=3, L=2))
    assert gradcheck(lambda *a: macchiato_attention(*a, window=4, chunk_size=4)[0], (q, k, v, mix, lat))


@pytest.mark.parametrize("needs", ["q", "k", "v", "mix", "lat", "mix+lat", "q+k+v+mix+lat"])
@pytest.mark.parametrize("T,chunk", [(64, 16), (75, 16)])  # 75: the latent output is a slice of a padded buffer
def test_gradients_match_reference_for_any_subset_of_inputs(needs, T, chunk):
    """The window branch is added into the latent output in place (a custom backward): each input's
    gradient alone, in the banded layout (T > w), against autograd through the dense references."""
    names = ["q", "k", "v", "mix", "lat"]
    inputs = _inputs(B=1, Hq=2, Hkv=1, T=T, d=8, L=3)
    fast = [x.clone().requires_grad_(n in needs.split("+")) for n, x in zip(names, inputs)]
    ref = [x.clone().requires_grad_(n in needs.split("+")) for n, x in zip(names, inputs)]
    grad = torch.randn(1, 2, T, 8, dtype=torch.float64)
    out, _ = macchiato_attention(*fast, window=16, chunk_size=chunk)
    out.backward(grad)
    macchiato_attention_reference(*ref, window=16).backward(grad)
    for n, a, b in zip(names, fast, ref):
        if n in needs.split("+"):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-10)


def test_bf16_within_tolerance():
    q, k, v, mix, lat = _inputs(dtype=torch.float32, T=200)
    args = [x.bfloat16() for x in (q, k, v, mix, lat)]
    out, _ = macchiato_attention(*args, window=32)
    ref = macchiato_attention_reference(*[x.double() for x in args], window=32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


# ---- the same op for prefill + decoding: cached window keys (num_past), the Latte state, sinks


def test_prefill_then_steps_equal_one_call():
    q, k, v, mix, lat = _inputs(T=40)
    mask = padding_mask(2, 40, [0, 5])
    kw = dict(window=8, scaling=0.3, softcap=20.0)
    full, _ = macchiato_attention(q, k, v, mix, lat, key_padding_mask=mask, **kw)
    P = 25
    prefix, state = macchiato_attention(
        q[:, :, :P], k[:, :, :P], v[:, :, :P], mix[:, :, :P], lat[:, :, :P], key_padding_mask=mask[:, :P],
        output_final_state=True, **kw,
    )
    outs = list(prefix.unbind(2)) + [None] * (40 - P)
    for t in range(P, 40):  # one token at a time, all earlier keys cached: the Latte step
        o, state = macchiato_attention(
            q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], mix[:, :, t:t + 1], lat[:, :, t:t + 1],
            key_padding_mask=mask[:, :t + 1], num_past=t, initial_state=state, output_final_state=True, **kw,
        )
        outs[t] = o[:, :, 0]
    torch.testing.assert_close(torch.stack(outs, 2), full, atol=1e-10, rtol=1e-10)


def test_no_latents_is_the_window_alone():
    q, k, v, mix, _ = _inputs(L=0)
    out, state = macchiato_attention(q, k, v, mix, None, window=16)
    assert state is None
    torch.testing.assert_close(out, sliding_window_attention(q, k, v, 16), atol=0, rtol=0)


def test_sinks_branch_is_the_sink_window_attention():
    from retrofit.ops import first_valid, sink_window_attention, sink_window_attention_reference

    q, k, v, mix, lat = _inputs(T=30)
    mask = padding_mask(2, 30, [0, 4])
    idx = torch.arange(30).expand(2, 30)
    sinks = first_valid(2, idx, mask, k, v)
    out, _ = macchiato_attention(q, k, v, mix, lat, window=6, key_padding_mask=mask, sinks=sinks)
    swa = sink_window_attention(q, k, v, 6, sinks[2], sinks[3], sinks[0], sinks[1], key_padding_mask=mask)
    torch.testing.assert_close(swa, sink_window_attention_reference(q, k, v, 6, 2, key_padding_mask=mask))
    no_latent = mix.clone()
    no_latent[..., 1:] = -1e4  # p(0|t) = 1 to fp64 precision: the output is the sinks + window branch
    out0, _ = macchiato_attention(q, k, v, no_latent, lat, window=6, key_padding_mask=mask, sinks=sinks)
    torch.testing.assert_close(out0, swa, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(out, swa)


@pytest.mark.parametrize("capped", [False, True])
def test_sinks_branch_values_and_gradients_match_the_dense_references(capped):
    """With attention sinks (and, with ``capped``, RoPE and the far sinks scored at a capped distance):
    values and the q, k, v and both logits' gradients over 200 tokens (GQA, soft-capping, padding,
    large logits) against autograd through the dense sink + window reference and the dense Latte."""
    from retrofit.ops import (capped_sinks, causal_latte_reference, first_valid, repeat_kv_heads, rope_rotate,
                              sink_window_attention_reference)

    T, window, n_sinks, distance = 200, 16, 3, 70
    q, k, v, mix, lat = _inputs(T=T, d=8, L=4)
    q, k = q * 3, k * 3
    mask = padding_mask(2, T, [0, 21])
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    pos = torch.arange(T)
    kw = dict(scaling=0.5, softcap=30.0, key_padding_mask=mask)

    def op(q, k, v, mix, lat):
        if capped:
            q, k = rope_rotate(q, pos, inv_freq), rope_rotate(k, pos, inv_freq)
        sinks = first_valid(n_sinks, pos.expand(2, T), mask, k, v)
        far = capped_sinks(q, sinks[2], sinks[0], 0, distance, inv_freq) if capped else None
        return macchiato_attention(q, k, v, mix, lat, window=window, chunk_size=32, sinks=sinks, far_sinks=far, **kw)[0]

    def reference(q, k, v, mix, lat):
        p = torch.softmax(mix, dim=-1)
        swa = sink_window_attention_reference(q, k, v, window, n_sinks, rope=(inv_freq, distance) if capped else None, **kw)
        latent = causal_latte_reference(p[..., 1:], lat, repeat_kv_heads(v, q.shape[1]), key_padding_mask=mask)
        return p[..., :1] * swa + latent

    assert_values_and_grads_match(op, reference, (q, k, v, mix, lat))
