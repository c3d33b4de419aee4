"""The gated delta rule: chunked form and decoding step against the token-by-token definition."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from retrofit.ops import DeltaState, delta_rule_chunked, delta_rule_reference, delta_rule_step
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import padding_mask


def _inputs(B=2, H=3, T=37, d=8, D=5, *, dtype=torch.float64, seed=0, decay=1.0, beta_max=1.0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, d, generator=g, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, H, T, d, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    beta = torch.rand(B, H, T, generator=g, dtype=torch.float64) * beta_max
    log_decay = -torch.rand(B, H, T, generator=g, dtype=torch.float64) * decay
    return [x.to(dtype) for x in (q, k, v, beta, log_decay)]


def test_reference_is_the_matrix_recurrence():
    """S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t, written out."""
    q, k, v, beta, g = _inputs(B=1, H=1, T=6, d=4, D=3)
    S = torch.zeros(4, 3, dtype=torch.float64)
    expected = []
    for t in range(6):
        kt = k[0, 0, t][:, None]
        S = g[0, 0, t].exp() * (torch.eye(4, dtype=torch.float64) - beta[0, 0, t] * kt @ kt.T) @ S + beta[0, 0, t] * kt @ v[0, 0, t][None]
        expected.append(0.5 * S.T @ q[0, 0, t])
    out, state = delta_rule_reference(q, k, v, beta, g, scale=0.5, output_final_state=True)
    torch.testing.assert_close(out[0, 0], torch.stack(expected))
    torch.testing.assert_close(state.memory[0, 0], S)


def test_a_full_strength_write_replaces_the_value_at_its_key():
    """The delta rule's point: writing v' at a key already holding v, with beta = 1, reads back v'
    exactly (an additive state would read v + v')."""
    k = F.normalize(torch.randn(1, 1, 1, 8, dtype=torch.float64), dim=-1).expand(1, 1, 2, 8)
    v = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    out, _ = delta_rule_reference(k, k, v, torch.ones(1, 1, 2, dtype=torch.float64))
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 1])


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 70), chunk=st.sampled_from([1, 3, 16, 64]), pad=st.integers(0, 9), decay=st.sampled_from([0.0, 0.1, 3.0]))
def test_chunked_matches_reference(T, chunk, pad, decay):
    q, k, v, beta, g = _inputs(T=T, decay=decay)
    mask = padding_mask(2, T, [0, pad])
    ref, ref_state = delta_rule_reference(q, k, v, beta, g, scale=0.7, key_padding_mask=mask, output_final_state=True)
    out, state = delta_rule_chunked(q, k, v, beta, g, scale=0.7, key_padding_mask=mask, output_final_state=True,
                                    chunk_size=chunk)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state.memory, ref_state.memory, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_gradients_match_reference(chunk):
    inputs = _inputs(T=23, d=6, D=4, decay=0.5)
    h0 = torch.randn(2, 3, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mask = padding_mask(2, 23, [0, 4])

    def run(fn, **kw):
        def f(q, k, v, beta, g, S0):
            out, state = fn(q, k, v, beta, g, scale=0.8, key_padding_mask=mask, initial_state=DeltaState(S0),
                            output_final_state=True, **kw)
            return torch.cat([out.flatten(), state.memory.flatten()])
        return f

    assert_values_and_grads_match(run(delta_rule_chunked, chunk_size=chunk), run(delta_rule_reference), [*inputs, h0])


def test_strong_decay_and_long_sequences_stay_finite_and_exact():
    """A log decay of -30 per token makes e^(c_i - c_j) span e^-1900 within a 64-token chunk: the
    exponents above the diagonal must never be formed (they would overflow to inf and give NaN)."""
    q, k, v, beta, g = _inputs(B=1, H=2, T=300, decay=30.0, beta_max=1.0)
    ref, _ = delta_rule_reference(q, k, v, beta, g)
    out, _ = delta_rule_chunked(q, k, v, beta, g, chunk_size=64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_unit_strength_writes_with_unnormalised_keys_in_fp32():
    """beta = 1 everywhere (the contraction's edge) over 512 tokens, keys of norm 1, fp32: the chunked
    form stays within fp32 rounding of the float64 definition."""
    q, k, v, _, _ = _inputs(B=1, H=2, T=512, d=16, D=16, seed=4)
    beta = torch.ones(1, 2, 512, dtype=torch.float64)
    ref, _ = delta_rule_reference(q, k, v, beta)
    out, _ = delta_rule_chunked(*(x.float() for x in (q, k, v, beta)), chunk_size=64)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-4, rtol=2e-4)


def test_bf16_inputs_run_in_fp32_and_return_bf16():
    q, k, v, beta, g = _inputs(T=100, decay=0.05)
    ref, _ = delta_rule_reference(q, k, v, beta, g)
    out, state = delta_rule_chunked(*(x.bfloat16() for x in (q, k, v, beta, g)), output_final_state=True)
    assert out.dtype == torch.bfloat16 and state.memory.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=0.06, rtol=0.05)


def test_padded_tokens_leave_the_state_and_output_zero():
    """Left padding (arbitrary, even non-finite, inputs there) changes nothing for the real tokens."""
    q, k, v, beta, g = _inputs(B=1, T=20)
    pad = 6
    junk = [torch.cat([torch.full_like(x[:, :, :pad], float("nan")), x], dim=2) for x in (q, k, v, beta, g)]
    mask = padding_mask(1, 20 + pad, [pad])
    out, state = delta_rule_chunked(*junk, key_padding_mask=mask, output_final_state=True, chunk_size=8)
    plain, plain_state = delta_rule_chunked(q, k, v, beta, g, output_final_state=True, chunk_size=8)
    assert (out[:, :, :pad] == 0).all()
    torch.testing.assert_close(out[:, :, pad:], plain, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state.memory, plain_state.memory, atol=1e-12, rtol=1e-12)


def test_steps_and_split_prefill_continue_the_chunked_form():
    q, k, v, beta, g = _inputs(T=40, decay=0.3)
    mask = padding_mask(2, 40, [0, 3])
    full, full_state = delta_rule_chunked(q, k, v, beta, g, key_padding_mask=mask, output_final_state=True, chunk_size=16)
    head, state = delta_rule_chunked(*(x[:, :, :25] for x in (q, k, v, beta, g)), key_padding_mask=mask[:, :25],
                                     output_final_state=True, chunk_size=16)
    outs = [head]
    for t in range(25, 40):
        o, state = delta_rule_step(*(x[:, :, t : t + 1] for x in (q, k, v, beta, g)), state, valid=mask[:, t : t + 1])
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state.memory, full_state.memory, atol=1e-12, rtol=1e-12)


def test_a_step_from_no_state_starts_from_zeros():
    q, k, v, beta, g = _inputs(T=1)
    ref, _ = delta_rule_reference(q, k, v, beta, g)
    out, state = delta_rule_step(q, k, v, beta, g)
    torch.testing.assert_close(out, ref)
    assert state.memory.shape == (2, 3, 8, 5)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size"):
        delta_rule_chunked(*_inputs(T=4), chunk_size=0)
