"""Causal Latte: chunked and recurrent forms against the O(T^2) reference (Definition 2)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from retrofit.ops import (
    LatteState,
    causal_latte,
    causal_latte_chunked,
    causal_latte_recurrent,
    causal_latte_reference,
    causal_latte_step,
)
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import latte_inputs, padding_mask


@pytest.fixture(scope="module", autouse=True, params=["matmul", "loop"])
def scan_form(request):
    """Every test here runs with both forms of the chunk-state scan: the batched GEMM (autograd, GPUs)
    and the loop (a CPU without autograd, or too many chunks for the GEMM's weights)."""
    from retrofit.ops import latte

    kept = latte.SCAN_MATMUL_MAX_ELEMENTS
    latte.SCAN_MATMUL_MAX_ELEMENTS = kept if request.param == "matmul" else -1
    yield request.param
    latte.SCAN_MATMUL_MAX_ELEMENTS = kept


@pytest.mark.parametrize("case", ["plain", "late keys", "initial state", "no keys", "spread"])
def test_chunk_state_scan_forms_agree(case):
    """The unrolled scan (one GEMM) equals the recurrence step by step, with chunks before any key
    (z = -inf), an initial state, no key at all, and normalisers that grow by hundreds of nats."""
    from retrofit.ops.latte import _scan_by_matmul, _scan_chunk_states

    g = torch.Generator().manual_seed(0)
    B, H, n, L, D = 2, 3, 9, 4, 5
    steps = torch.rand(B, H, n, L, generator=g, dtype=torch.float64) * (300.0 if case == "spread" else 2.0)
    z_init = torch.full((B, H, 1, L), float("-inf"), dtype=torch.float64)
    m_init = torch.zeros(B, H, L, D, dtype=torch.float64)
    if case == "initial state":
        z_init = torch.randn(B, H, 1, L, generator=g, dtype=torch.float64)
        m_init = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    z_end = torch.logcumsumexp(torch.cat([z_init, steps], dim=2), dim=2)[:, :, 1:]
    if case in ("late keys", "no keys"):
        z_end[:, :, : (n if case == "no keys" else 4)] = float("-inf")
    z_bound = torch.cat([z_init, z_end], dim=2)
    contrib = torch.randn(B, H, n, L, D, generator=g, dtype=torch.float64)
    contrib = torch.where(torch.isfinite(z_end).unsqueeze(-1), contrib, torch.zeros(()))  # no key, no value
    r = torch.where(torch.isfinite(z_end), z_end, torch.zeros(()))
    decay = torch.exp(z_bound[:, :, :-1] - r)
    with torch.no_grad():  # the loop: a CPU without autograd
        want = _scan_chunk_states(contrib, decay, m_init, z_bound)
    got = _scan_by_matmul(contrib, m_init, z_bound)
    for x, y in zip(got, want):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_reference_matches_definition_by_hand():
    # one head, one latent: m_t is the exp(a)-weighted mean of v_1..v_t
    a = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64).view(1, 1, 3, 1)
    v = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64).view(1, 1, 3, 1)
    q = torch.ones_like(a)
    w = a.exp().flatten()
    expected = torch.stack([(w[: t + 1] * v.flatten()[: t + 1]).sum() / w[: t + 1].sum() for t in range(3)])
    out = causal_latte_reference(q, a, v)
    torch.testing.assert_close(out.flatten(), expected)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    T=st.integers(1, 70),
    L=st.integers(1, 6),
    D=st.integers(1, 5),
    chunk=st.sampled_from([1, 3, 8, 16, 64]),
)
def test_chunked_matches_reference(B, H, T, L, D, chunk):
    q, k, v = latte_inputs(B, H, T, L, D)
    ref = causal_latte_reference(q, k, v)
    out, _ = causal_latte_chunked(q, k, v, chunk_size=chunk)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("T,chunk", [(1, 16), (17, 16), (64, 16), (100, 32)])
def test_recurrent_and_final_state_match_chunked(T, chunk):
    q, k, v = latte_inputs(2, 2, T, 4, 3)
    mask = padding_mask(2, T, [0, min(5, T - 1)])
    out_c, st_c = causal_latte_chunked(q, k, v, chunk_size=chunk, key_padding_mask=mask, output_final_state=True)
    out_r, st_r = causal_latte_recurrent(q, k, v, key_padding_mask=mask)
    ref = causal_latte_reference(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out_c, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out_r, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(st_c.m, st_r.m, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(st_c.z, st_r.z)


def test_prefill_then_steps_equals_full_sequence():
    T, split = 50, 23
    q, k, v = latte_inputs(2, 2, T, 5, 4)
    full = causal_latte_reference(q, k, v)
    pre, state = causal_latte_chunked(q[:, :, :split], k[:, :, :split], v[:, :, :split], chunk_size=8, output_final_state=True)
    outs = [pre]
    for t in range(split, T):
        o, state = causal_latte_step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        outs.append(o[:, :, None])
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-10, rtol=1e-10)
    # and a second chunked call from a carried state
    rest, _ = causal_latte_chunked(q[:, :, split:], k[:, :, split:], v[:, :, split:], chunk_size=7,
                                   initial_state=causal_latte_chunked(q[:, :, :split], k[:, :, :split], v[:, :, :split], output_final_state=True)[1])
    torch.testing.assert_close(rest, full[:, :, split:], atol=1e-10, rtol=1e-10)


def test_left_padding_contributes_nothing():
    T, pad = 30, 9
    q, k, v = latte_inputs(1, 2, T - pad, 4, 3)
    alone = causal_latte_reference(q, k, v)
    # same sequence behind `pad` garbage positions with huge logits and values
    qp = torch.cat([torch.rand(1, 2, pad, 4, dtype=q.dtype), q], dim=2)
    kp = torch.cat([torch.full((1, 2, pad, 4), 80.0, dtype=k.dtype), k], dim=2)
    vp = torch.cat([torch.full((1, 2, pad, 3), 1e4, dtype=v.dtype), v], dim=2)
    mask = padding_mask(1, T, [pad])
    out, _ = causal_latte_chunked(qp, kp, vp, chunk_size=8, key_padding_mask=mask)
    torch.testing.assert_close(out[:, :, pad:], alone, atol=1e-10, rtol=1e-10)
    assert torch.all(out[:, :, :pad] == 0)
    out_r, _ = causal_latte_recurrent(qp, kp, vp, key_padding_mask=mask)
    torch.testing.assert_close(out_r[:, :, pad:], alone, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("spread", [50.0, 200.0, 2000.0])
def test_large_logit_spread_is_finite_and_exact_in_fp32(spread):
    torch.manual_seed(1)
    q, k, v = latte_inputs(2, 2, 150, 8, 16, dtype=torch.float64, spread=1.0)
    k = k * spread / 2  # logits spread over ~[-spread, spread] inside each chunk
    k[:, :, 40] += spread  # an abrupt jump of the running max mid-chunk
    ref = causal_latte_reference(q, k, v)
    out, state = causal_latte_chunked(q.float(), k.float(), v.float(), chunk_size=64, output_final_state=True)
    assert torch.isfinite(out).all() and torch.isfinite(state.m).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    out_r, _ = causal_latte_recurrent(q.float(), k.float(), v.float())
    torch.testing.assert_close(out_r.double(), ref, atol=2e-5, rtol=2e-5)


def test_fp32_matches_reference_to_1e5():
    q, k, v = latte_inputs(2, 4, 333, 16, 32, dtype=torch.float32, spread=5.0)
    mask = padding_mask(2, 333, [0, 17])
    ref = causal_latte_reference(q.double(), k.double(), v.double(), key_padding_mask=mask)
    out, _ = causal_latte_chunked(q, k, v, chunk_size=64, key_padding_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bf16_inputs_within_bf16_tolerance():
    q, k, v = latte_inputs(2, 2, 200, 8, 16, dtype=torch.float32, spread=4.0)
    ref = causal_latte_reference(q.double(), k.double(), v.double())
    out, _ = causal_latte_chunked(q.bfloat16(), k.bfloat16(), v.bfloat16(), chunk_size=32)
    assert out.dtype == torch.bfloat16
    # inputs are rounded to bf16 (8 bits of mantissa); the math runs in fp32
    torch.testing.assert_close(out.double(), ref, atol=5e-2, rtol=5e-2)
    ref_rounded = causal_latte_reference(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double())
    torch.testing.assert_close(out.double(), ref_rounded, atol=1e-2, rtol=1e-2)


def test_gradcheck_chunked_float64():
    q, k, v = latte_inputs(2, 2, 11, 3, 2, normalised=False)
    mask = padding_mask(2, 11, [0, 3])
    args = [x.clone().requires_grad_() for x in (q, k, v)]
    assert gradcheck(lambda a, b, c: causal_latte_chunked(a, b, c, chunk_size=4, key_padding_mask=mask)[0], args)


def test_gradcheck_through_initial_state():
    q, k, v = latte_inputs(1, 2, 9, 3, 2, normalised=False)
    state_m = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    state_z = torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True)
    args = [x.clone().requires_grad_() for x in (q, k, v)]

    def f(a, b, c, m, z):
        out, fin = causal_latte_chunked(a, b, c, chunk_size=4, initial_state=LatteState(m, z), output_final_state=True)
        return out, fin.m, fin.z

    assert gradcheck(f, (*args, state_m, state_z))


def test_gradients_match_reference_fp32():
    q, k, v = latte_inputs(2, 3, 130, 8, 16, dtype=torch.float32, spread=4.0)
    mask = padding_mask(2, 130, [0, 10])
    g = torch.randn(2, 3, 130, 16)
    grads = []
    for fn in (
        lambda a, b, c: causal_latte_reference(a.double(), b.double(), c.double(), key_padding_mask=mask),
        lambda a, b, c: causal_latte_chunked(a, b, c, chunk_size=32, key_padding_mask=mask)[0],
    ):
        args = [x.clone().requires_grad_() for x in (q, k, v)]
        (fn(*args).double() * g).sum().backward()
        grads.append([x.grad for x in args])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [None, 77, 128])
def test_values_and_gradients_match_reference_float64(split):
    """300 tokens, padded rows, logit spreads of ~60 nats: values and q, k, v gradients of the chunked
    form against autograd through the O(T^2) reference; with ``split`` a second call continues the
    first's final state (its gradient flows back through the state) over the rest."""
    T = 300
    q, k, v = latte_inputs(2, 2, T, 6, 5, spread=20.0)
    mask = padding_mask(2, T, [0, 33])

    def op(q, k, v):
        if split is None:
            return causal_latte_chunked(q, k, v, chunk_size=32, key_padding_mask=mask)[0]
        first, state = causal_latte_chunked(q[:, :, :split], k[:, :, :split], v[:, :, :split], chunk_size=32,
                                            key_padding_mask=mask[:, :split], output_final_state=True)
        rest, _ = causal_latte_chunked(q[:, :, split:], k[:, :, split:], v[:, :, split:], chunk_size=32,
                                       key_padding_mask=mask[:, split:], initial_state=state)
        return torch.cat([first, rest], dim=2)

    assert_values_and_grads_match(op, lambda q, k, v: causal_latte_reference(q, k, v, key_padding_mask=mask), (q, k, v))


def test_recurrent_values_and_gradients_match_reference_float64():
    """The decoding step, looped over 120 padded tokens: values and q, k, v gradients through the state."""
    q, k, v = latte_inputs(2, 2, 120, 5, 4, spread=20.0)
    mask = padding_mask(2, 120, [0, 17])
    assert_values_and_grads_match(
        lambda q, k, v: causal_latte_recurrent(q, k, v, key_padding_mask=mask)[0],
        lambda q, k, v: causal_latte_reference(q, k, v, key_padding_mask=mask),
        (q, k, v),
    )


def test_from_logits_values_and_gradients_match_reference_float64():
    q_logits, k, v = latte_inputs(2, 2, 200, 5, 4, spread=10.0)
    q_logits = q_logits * 30
    mask = padding_mask(2, 200, [0, 50])
    assert_values_and_grads_match(
        lambda a, b, c: causal_latte(a, b, c, chunk_size=16, key_padding_mask=mask),
        lambda a, b, c: causal_latte_reference(torch.softmax(a, -1), b, c, key_padding_mask=mask),
        (q_logits, k, v),
    )


def test_causal_latte_from_logits_is_a_distribution_over_past_values():
    # with v = 1 everywhere and p(l|t) summing to one, every output is exactly 1
    q_logits = torch.randn(2, 2, 40, 5) * 10
    k_logits = torch.randn(2, 2, 40, 5) * 10
    v = torch.ones(2, 2, 40, 3)
    out = causal_latte(q_logits, k_logits, v, chunk_size=16)
    torch.testing.assert_close(out, torch.ones_like(out))


def test_causality_future_tokens_do_not_change_the_past():
    q, k, v = latte_inputs(1, 2, 40, 4, 3)
    out, _ = causal_latte_chunked(q, k, v, chunk_size=16)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 25:] += 100.0
    v2[:, :, 25:] = -v2[:, :, 25:]
    out2, _ = causal_latte_chunked(q, k2, v2, chunk_size=16)
    torch.testing.assert_close(out[:, :, :25], out2[:, :, :25])
    assert not torch.allclose(out[:, :, 25:], out2[:, :, 25:])


@pytest.mark.parametrize("spread,jump", [(60.0, 0.0), (20.0, 120.0), (400.0, 400.0)])
def test_gradients_with_extreme_logit_growth_match_reference(spread, jump):
    """Chunks whose normaliser grows by more than FACTORISED_MAX_RANGE nats take the log-space form;
    forward and backward still match the reference, with left padding: exactly in fp64, and in fp32
    to the resolution of fp32 logits of that size (|k| 2^-24 per exponent, over <= T terms)."""
    torch.manual_seed(2)
    q, k, v = latte_inputs(2, 2, 150, 6, 5, dtype=torch.float64, spread=1.0)
    k = k * spread / 2
    k[:, :, 40] += jump  # a key far above everything before it, mid-chunk
    k[:, :, 100, :3] += jump / 2
    mask = padding_mask(2, 150, [0, 13])
    g = torch.randn(2, 2, 150, 5, dtype=torch.float64)

    def run(fn, dtype):
        # every form sees the fp32-rounded inputs, so only the kernel's own error is measured
        args = [x.detach().float().to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*args)
        assert torch.isfinite(out).all()
        (out.double() * g).sum().backward()
        return [out.detach().double(), *(x.grad.double() for x in args)]

    want = run(lambda a, b, c: causal_latte_reference(a, b, c, key_padding_mask=mask), torch.float64)
    chunked = lambda a, b, c: causal_latte_chunked(a, b, c, chunk_size=32, key_padding_mask=mask)[0]  # noqa: E731
    for got, ref in zip(run(chunked, torch.float64), want):
        torch.testing.assert_close(got, ref, atol=1e-9, rtol=1e-9)
    tol = 2e-5 + 1e-5 * float(k.abs().max())
    for got, ref in zip(run(chunked, torch.float32), want):
        assert torch.isfinite(got).all()
        scale = ref.abs().max()
        torch.testing.assert_close(got / scale, ref / scale, atol=tol, rtol=0)


@pytest.mark.parametrize("chunks_per_segment", [1, 3])
@pytest.mark.parametrize("pads,spread,with_state", [(None, 3.0, False), ([0, 40], 3.0, True), ([5, 0], 300.0, False)])
def test_no_grad_segments_equal_one_pass(monkeypatch, chunks_per_segment, pads, spread, with_state):
    """Without autograd the chunked form runs segments of a few chunks, each from the state the
    last one ended with: outputs and final state equal one pass (padding longer than a segment,
    a carried initial state, logit jumps that take the log-space redo)."""
    import retrofit.ops.latte as latte_module

    B, H, T, L, D, C = 2, 2, 150, 4, 3, 16
    q, k, v = latte_inputs(B, H, T, L, D, spread=spread)
    k[:, :, 70] += spread  # a jump of the running normaliser inside a later segment
    mask = None if pads is None else padding_mask(B, T, pads)
    state = None
    if with_state:
        q0, k0, v0 = latte_inputs(B, H, 20, L, D)
        state = causal_latte_chunked(q0, k0, v0, chunk_size=C, output_final_state=True)[1]
    kwargs = dict(chunk_size=C, key_padding_mask=mask, initial_state=state, output_final_state=True)
    with torch.no_grad():
        whole, whole_state = causal_latte_chunked(q, k, v, **kwargs)
    calls = []
    real = latte_module._segmented
    monkeypatch.setattr(latte_module, "_segmented", lambda *a: calls.append(a[3]) or real(*a))
    monkeypatch.setattr(latte_module, "NO_GRAD_STATE_BYTES", chunks_per_segment * 2 * B * H * L * D * 8)
    with torch.no_grad():
        out, final = causal_latte_chunked(q, k, v, **kwargs)
    assert calls == [chunks_per_segment * C]
    torch.testing.assert_close(out, whole, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(final.m, whole_state.m, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(final.z, whole_state.z, atol=1e-12, rtol=1e-12)
    # with autograd recording, one pass (its backward needs every chunk-start state)
    calls.clear()
    tracked, _ = causal_latte_chunked(q.requires_grad_(), k, v, **kwargs)
    assert calls == []
    torch.testing.assert_close(tracked.detach(), whole, atol=1e-12, rtol=1e-12)
