"""The Hedgehog read beyond a window: feature maps, and the chunked form against the dense definition
(values, final states and gradients; cached past keys, streamed calls, skipped keys, bf16)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrofit.ops.hedgehog import (
    HedgehogState, hedgehog_features, hedgehog_read_chunked, hedgehog_read_reference, hedgehog_read_step,
)
from tests.ops._grads import assert_values_and_grads_match


def _inputs(B=2, H=3, T=37, P=0, Fe=6, D=5, *, seed=0, dtype=torch.float64, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    fq = torch.rand(B, H, T, Fe, generator=g, dtype=torch.float64) * spread
    fk = torch.rand(B, H, P + T, Fe, generator=g, dtype=torch.float64) * spread
    v = torch.randn(B, H, P + T, D, generator=g, dtype=torch.float64)
    write = torch.rand(B, P + T, generator=g) > 0.25
    return [x.to(dtype) for x in (fq, fk, v)] + [write]


def _state(B=2, H=3, Fe=6, D=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return HedgehogState(torch.randn(B, H, Fe, D, generator=g, dtype=torch.float64),
                         torch.rand(B, H, Fe, generator=g, dtype=torch.float64))


def test_features_are_two_softmaxes_of_the_map():
    x, w = torch.randn(2, 3, 5, 8, dtype=torch.float64), torch.randn(3, 4, 8, dtype=torch.float64)
    phi = hedgehog_features(x, w)
    z = torch.einsum("bhtd,hfd->bhtf", x, w)
    torch.testing.assert_close(phi, torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1))
    assert phi.dtype == torch.float64 and hedgehog_features(x.to(torch.bfloat16), w).dtype == torch.float32


def test_reference_reads_exactly_the_written_keys_beyond_the_window():
    """Written out: query t reads the keys s <= t - w that are written, plus the initial state."""
    fq, fk, v, write = _inputs(B=1, H=1, T=12)
    S0 = _state(B=1, H=1)
    num, mass, state = hedgehog_read_reference(fq, fk, v, write, window=4, initial_state=S0, output_final_state=True)
    for t in range(12):
        keys = [s for s in range(t - 4 + 1) if write[0, s]]
        kappa = torch.stack([fq[0, 0, t] @ fk[0, 0, s] for s in keys]) if keys else torch.zeros(0, dtype=torch.float64)
        want = fq[0, 0, t] @ S0.S[0, 0] + (kappa @ v[0, 0, keys] if keys else 0)
        torch.testing.assert_close(num[0, 0, t], want)
        torch.testing.assert_close(mass[0, 0, t], fq[0, 0, t] @ S0.z[0, 0] + kappa.sum())
    kept = [s for s in range(12 - 4 + 1) if write[0, s]]  # the keys no later window holds: s <= 11 - 4 + 1
    torch.testing.assert_close(state.S[0, 0], S0.S[0, 0] + fk[0, 0, kept].T @ v[0, 0, kept])
    torch.testing.assert_close(state.z[0, 0], S0.z[0, 0] + fk[0, 0, kept].sum(0))


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 60), P=st.integers(0, 7), window=st.integers(1, 12), chunk=st.sampled_from([1, 4, 16, 64]),
       with_state=st.booleans())
def test_chunked_matches_reference(T, P, window, chunk, with_state):
    P = min(P, window - 1)
    fq, fk, v, write = _inputs(T=T, P=P)
    state = _state() if with_state else None
    kw = dict(window=window, num_past=P, initial_state=state, output_final_state=True)
    got = hedgehog_read_chunked(fq, fk, v, write, chunk_size=chunk, **kw)
    want = hedgehog_read_reference(fq, fk, v, write, **kw)
    for a, b in [(got[0], want[0]), (got[1], want[1]), (got[2].S, want[2].S), (got[2].z, want[2].z)]:
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("window,with_state,spread", [(1, False, 1.0), (5, True, 1.0), (8, False, 30.0)])
def test_steps_equal_the_reference(window, with_state, spread):
    """Token by token (each query reads the state, then the state takes key t - w + 1) = one dense call."""
    T = 23
    fq, fk, v, write = _inputs(T=T, spread=spread)
    S0 = _state() if with_state else None
    num, mass, final = hedgehog_read_reference(fq, fk, v, write, window=window, initial_state=S0, output_final_state=True)
    state = S0
    for t in range(T):
        j = t - window + 1
        leaving = slice(max(j, 0), max(j, 0) + 1)
        ok = write[:, leaving] & (j >= 0)
        n_t, m_t, state = hedgehog_read_step(fq[:, :, t : t + 1], fk[:, :, leaving], v[:, :, leaving], ok, state)
        torch.testing.assert_close(n_t[:, :, 0], num[:, :, t])
        torch.testing.assert_close(m_t[:, :, 0], mass[:, :, t])
    torch.testing.assert_close(state.S, final.S)
    torch.testing.assert_close(state.z, final.z)


@pytest.mark.parametrize("T,P,window,chunk,with_state", [(37, 0, 8, 16, True), (29, 7, 8, 5, True), (3, 5, 6, 64, True),
                                                          (45, 2, 20, 4, False)])  # the last skips the empty chunks
def test_chunked_gradients_match_reference(T, P, window, chunk, with_state):
    fq, fk, v, write = _inputs(T=T, P=P)
    S = _state()

    def run(fn, **extra):
        def f(fq, fk, v, *state):
            num, mass, st_ = fn(fq, fk, v, write, window=window, num_past=P,
                                initial_state=HedgehogState(*state) if state else None, output_final_state=True, **extra)
            return torch.cat([num.flatten(), mass.flatten(), st_.S.flatten(), st_.z.flatten()])
        return f

    inputs = [fq, fk, v] + ([S.S, S.z] if with_state else [])
    assert_values_and_grads_match(run(hedgehog_read_chunked, chunk_size=chunk), run(hedgehog_read_reference), inputs)


@pytest.mark.parametrize("cuts", [(11, 12, 20), (1, 2, 3, 30), (9,)])
def test_streamed_calls_equal_one_call(cuts):
    """Calls over consecutive pieces, each with the last w - 1 keys before it as its past and the
    state the previous call returned, read what one call over the whole sequence reads."""
    T, w = 41, 8
    fq, fk, v, write = _inputs(T=T)
    whole = hedgehog_read_reference(fq, fk, v, write, window=w)
    state, nums, masses = None, [], []
    for lo, hi in zip((0,) + cuts, cuts + (T,)):
        P = min(lo, w - 1)
        num, mass, state = hedgehog_read_chunked(fq[:, :, lo:hi], fk[:, :, lo - P:hi], v[:, :, lo - P:hi],
                                                 write[:, lo - P:hi], window=w, num_past=P, initial_state=state,
                                                 output_final_state=True, chunk_size=4)
        nums.append(num)
        masses.append(mass)
    torch.testing.assert_close(torch.cat(nums, 2), whole[0])
    torch.testing.assert_close(torch.cat(masses, 2), whole[1])


def test_unwritten_keys_with_non_finite_values_change_nothing():
    fq, fk, v, write = _inputs(T=30)
    write[:, 3] = False
    v2, fk2 = v.clone(), fk.clone()
    v2[:, :, 3], fk2[:, :, 3] = float("nan"), float("inf")
    for fn in (hedgehog_read_chunked, hedgehog_read_reference):
        a = fn(fq, fk, v, write, window=5, output_final_state=True)
        b = fn(fq, fk2, v2, write, window=5, output_final_state=True)
        torch.testing.assert_close(a[0], b[0])
        torch.testing.assert_close(a[2].S, b[2].S)


def test_long_sequence_and_spiky_features_in_bf16_stay_close():
    """4K tokens of near one-hot features (the shape fitted maps take), bf16 inputs: the fp32
    chunked read against the fp64 reference."""
    fq, fk, v, write = _inputs(B=1, H=2, T=4096, Fe=16, D=8, spread=30.0)
    fq, fk = torch.softmax(fq, -1), torch.softmax(fk, -1)
    got = hedgehog_read_chunked(fq.bfloat16(), fk.bfloat16(), v.bfloat16(), write, window=256)
    want = hedgehog_read_reference(fq.bfloat16().double(), fk.bfloat16().double(), v.bfloat16().double(), write,
                                   window=256)
    assert got[0].dtype == torch.float32
    read, read_ref = got[0] / got[1][..., None].clamp_min(1e-30), want[0] / want[1][..., None].clamp_min(1e-30)
    torch.testing.assert_close(read[:, :, 256:].double(), read_ref[:, :, 256:], atol=1e-4, rtol=1e-3)
    assert torch.isfinite(got[0]).all() and (got[1][:, :, :256] == 0).all()


def test_bad_shapes_raise():
    fq, fk, v, write = _inputs(T=10, P=3)
    with pytest.raises(ValueError, match="num_past"):
        hedgehog_read_chunked(fq, fk, v, write, window=3, num_past=3)
    with pytest.raises(ValueError, match="num_past"):
        hedgehog_read_chunked(fq, fk, v, write, window=8, num_past=2)
