"""slot_attention_step (one decoding query over preallocated key slots) and macchiato_slot_step
against the dense references: slot order must not matter, masked slots must not count."""
from __future__ import annotations

import pytest
import torch

from retrofit.ops import LatteState, macchiato_attention, macchiato_slot_step, slot_attention_step


def _dense(q, k, v, allowed, scaling, softcap):
    """Plain softmax over the allowed slots, KV heads repeated, in float64."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.matmul(q.double(), kk.transpose(-1, -2)) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(s, -1), vv)


def _slots(B=2, Hq=4, Hkv=2, S=23, d=16, dtype=torch.float64, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, 1, d, generator=g) * scale).to(dtype)
    k = (torch.randn(B, Hkv, S, d, generator=g) * scale).to(dtype)
    v = torch.randn(B, Hkv, S, d, generator=g).to(dtype)
    allowed = torch.rand(B, S, generator=g) < 0.6
    allowed[:, -1] = True  # the new token's own slot
    return q, k, v, allowed


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_step_matches_dense_softmax_forward_and_backward(softcap, Hkv):
    q, k, v, allowed = _slots(Hkv=Hkv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = slot_attention_step(*leaves, allowed, scaling=0.3, softcap=softcap)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _dense(*ref_leaves, allowed, 0.3, softcap)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    w = torch.randn_like(ref)
    g_got = torch.autograd.grad((got * w).sum(), leaves)
    g_ref = torch.autograd.grad((ref * w).sum(), ref_leaves)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # a masked slot gets no gradient
    assert g_got[1][:, :, ~allowed[0]][0].abs().max() == 0


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_step_log_sum_exp_is_the_allowed_scores(softcap):
    q, k, v, allowed = _slots(Hkv=2, scale=4.0)  # large logits
    out, lse = slot_attention_step(q, k, v, allowed, scaling=0.3, softcap=softcap, with_lse=True)
    torch.testing.assert_close(out, slot_attention_step(q, k, v, allowed, scaling=0.3, softcap=softcap))
    s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    want = torch.logsumexp(s.masked_fill(~allowed[:, None, None, :], float("-inf")), -1)
    torch.testing.assert_close(lse, want, atol=1e-12, rtol=1e-12)


def test_slot_order_and_masked_contents_do_not_matter():
    q, k, v, allowed = _slots()
    perm = torch.randperm(k.shape[2])
    a = slot_attention_step(q, k, v, allowed)
    b = slot_attention_step(q, k[:, :, perm], v[:, :, perm], allowed[:, perm])
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    junk_k, junk_v = k.clone(), v.clone()
    junk_k[:, :, ~allowed[0]] = 1e6  # huge stale keys / values in masked slots (row 0's mask, both rows)
    junk_v[:, :, ~allowed[0]] = -1e6
    allowed_both = allowed.clone()
    allowed_both[1] = allowed[0]
    torch.testing.assert_close(
        slot_attention_step(q, junk_k, junk_v, allowed_both),
        slot_attention_step(q, k, v, allowed_both),
        atol=1e-12, rtol=1e-12,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_and_half_precision_stay_finite_and_close(dtype):
    q, k, v, allowed = _slots(dtype=torch.float32, scale=12.0)  # logit spreads in the hundreds
    ref = _dense(q, k, v, allowed, q.shape[-1] ** -0.5, None)
    got = slot_attention_step(q.to(dtype), k.to(dtype), v.to(dtype), allowed)
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)


def test_more_than_one_query_is_refused():
    q, k, v, allowed = _slots()
    with pytest.raises(ValueError, match="one query"):
        slot_attention_step(q.expand(-1, -1, 2, -1), k, v, allowed)


@pytest.mark.parametrize("latents", [0, 3])
def test_macchiato_slot_step_equals_the_general_op_on_one_token(latents):
    """The slot step over a shuffled [sinks | window] = macchiato_attention's decoding call over
    the chronological window with the same sinks (state carried from a prefill)."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, d, w, n, P = 2, 4, 2, 8, 6, 2, 5  # P = w - 1 buffered window keys
    q = torch.randn(B, Hq, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, P + 1, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, P + 1, d, generator=g, dtype=torch.float64)
    sk = torch.randn(B, Hkv, n, d, generator=g, dtype=torch.float64)
    sv = torch.randn(B, Hkv, n, d, generator=g, dtype=torch.float64)
    mix = torch.randn(B, Hq, 1, latents + 1, generator=g, dtype=torch.float64) * 3
    lat = torch.randn(B, Hq, 1, latents, generator=g, dtype=torch.float64) * 3 if latents else None
    state = LatteState(torch.randn(B, Hq, latents, d, dtype=torch.float64), torch.randn(B, Hq, latents, dtype=torch.float64)) if latents else None
    seen = 40  # stream index of the new token: both sinks (0, 1) lie before its window
    want, want_state = macchiato_attention(
        q, k, v, mix, lat, window=w, num_past=P, sinks=(torch.tensor([[0, 1]] * B), torch.ones(B, n, dtype=torch.bool), sk, sv),
        q_start=seen, initial_state=state, output_final_state=True,
    )
    perm = torch.randperm(n + P + 1, generator=g)
    slot_k, slot_v = torch.cat([sk, k], 2)[:, :, perm], torch.cat([sv, v], 2)[:, :, perm]
    allowed = torch.ones(B, n + P + 1, dtype=torch.bool)
    got, got_state = macchiato_slot_step(q, slot_k, slot_v, allowed, v[:, :, -1:], mix, lat, state)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    if latents:
        torch.testing.assert_close(got_state.m, want_state.m, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(got_state.z, want_state.z, atol=1e-12, rtol=1e-12)
