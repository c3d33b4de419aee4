"""Tiled LM-head training losses (CE + KL, with gradients) against the dense logits they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from retrofit.ops.head_loss import IGNORE_INDEX, linear_head_losses, linear_head_losses_reference


def _loop_reference(hidden, weight, targets, teacher, bias, softcap):
    """Independent fp64 evaluation, one position at a time, from the definitions."""
    kl, nll = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for i, h in enumerate(hidden.double()):
        def z_of(x):
            z = weight.double() @ x + (0 if bias is None else bias.double())
            return torch.tanh(z / softcap) * softcap if softcap else z
        logp = z_of(h) - torch.logsumexp(z_of(h), 0)
        if targets is not None and int(targets[i]) != IGNORE_INDEX:
            nll = nll - logp[int(targets[i])]
        if teacher is not None:
            zt = z_of(teacher[i].double())
            logq = zt - torch.logsumexp(zt, 0)
            kl = kl + (logq.exp() * (logq - logp)).sum()
    return kl, nll


def _inputs(N, V, D, seed, *, with_bias=False, ignore=0.0, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, D, generator=g, dtype=dtype) * scale).requires_grad_(True)
    weight = torch.randn(V, D, generator=g, dtype=dtype).requires_grad_(True)
    bias = torch.randn(V, generator=g, dtype=dtype).requires_grad_(True) if with_bias else None
    teacher = hidden.detach() + 0.5 * torch.randn(N, D, generator=g, dtype=dtype) * scale
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < ignore] = IGNORE_INDEX
    return hidden, weight, bias, teacher, targets


def _grads(loss, *tensors):
    present = [t for t in tensors if t is not None]
    return torch.autograd.grad(loss, present)


@settings(max_examples=30, deadline=None)
@given(
    N=st.integers(1, 30),
    V=st.integers(1, 50),
    D=st.integers(1, 7),
    token_block=st.integers(1, 13),
    vocab_block=st.integers(1, 17),
    with_bias=st.booleans(),
    softcap=st.sampled_from([None, 0.5, 30.0]),
    terms=st.sampled_from(["lm", "kl", "both"]),
    seed=st.integers(0, 2**16),
)
def test_tiled_matches_dense_and_definition_forward_and_backward(N, V, D, token_block, vocab_block, with_bias,
                                                                 softcap, terms, seed):
    hidden, weight, bias, teacher, targets = _inputs(N, V, D, seed, with_bias=with_bias, ignore=0.3)
    targets = None if terms == "kl" else targets
    teacher = None if terms == "lm" else teacher
    want_kl, want_nll = _loop_reference(hidden.detach(), weight.detach(), targets, teacher,
                                        None if bias is None else bias.detach(), softcap)
    kl, nll = linear_head_losses(hidden, weight, targets, teacher, bias=bias, softcap=softcap,
                                 token_block=token_block, vocab_block=vocab_block)
    ref_kl, ref_nll = linear_head_losses_reference(hidden, weight, targets, teacher, bias=bias, softcap=softcap)
    assert kl.dtype == nll.dtype == torch.float64 and kl.shape == nll.shape == ()  # fp64 head: fp64 sums
    for got, ref, want in ((kl, ref_kl, want_kl), (nll, ref_nll, want_nll)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    # weighted sum, so a mix-up of the two upstream gradients cannot cancel out
    got_g = _grads(0.7 * kl + 1.3 * nll, hidden, weight, bias)
    ref_g = _grads(0.7 * ref_kl + 1.3 * ref_nll, hidden, weight, bias)
    for g, r in zip(got_g, ref_g):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_gradcheck_through_every_input(softcap):
    hidden, weight, bias, teacher, targets = _inputs(7, 11, 3, 0, with_bias=True, ignore=0.3)

    def lm(h, w, b):
        return linear_head_losses(h, w, targets, None, bias=b, softcap=softcap, token_block=3, vocab_block=4)[1]

    def both(h):  # the teacher's logits depend on the head too, and take no gradient: vary the student only
        kl, nll = linear_head_losses(h, weight.detach(), targets, teacher, bias=bias.detach(), softcap=softcap,
                                     token_block=3, vocab_block=4)
        return 0.6 * kl + nll

    assert torch.autograd.gradcheck(lm, (hidden, weight, bias))
    assert torch.autograd.gradcheck(both, (hidden,))


def test_targets_on_every_block_boundary():
    V, vb = 64, 8
    hidden, weight, _, teacher, _ = _inputs(6, V, 5, 1)
    targets = torch.tensor([0, vb - 1, vb, 2 * vb - 1, V - 1, V - vb])
    got = linear_head_losses(hidden, weight, targets, teacher, token_block=4, vocab_block=vb)
    want = linear_head_losses_reference(hidden, weight, targets, teacher)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    for g, w in zip(_grads(sum(got), hidden, weight), _grads(sum(want), hidden, weight)):
        torch.testing.assert_close(g, w)


def test_large_logit_spreads_do_not_overflow():
    """Logits of +-1e4 (exp overflows fp32 a hundred times over), student and teacher apart:
    the running log-sum-exps and the KL's carried sum stay exact, and so do the gradients."""
    hidden, weight, _, teacher, targets = _inputs(12, 300, 16, 2, scale=3e3, dtype=torch.float32)
    kl, nll = linear_head_losses(hidden, weight, targets, teacher, token_block=5, vocab_block=7)
    want_kl, want_nll = _loop_reference(hidden.detach(), weight.detach(), targets, teacher, None, None)
    assert torch.isfinite(kl) and torch.isfinite(nll)
    torch.testing.assert_close(kl.double(), want_kl, rtol=1e-4, atol=1.0)
    torch.testing.assert_close(nll.double(), want_nll, rtol=1e-4, atol=1.0)
    got = _grads(kl + nll, hidden, weight)
    want = _grads(sum(linear_head_losses_reference(hidden, weight, targets, teacher)), hidden, weight)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-2)


def test_bf16_head_matches_its_own_logits():
    """A bf16 head: matmuls in bf16 as the model's head runs them, reductions and accumulators in fp32."""
    hidden, weight, _, teacher, targets = _inputs(40, 500, 32, 3, dtype=torch.float32)
    hb, wb = hidden.detach().bfloat16().requires_grad_(True), weight.detach().bfloat16().requires_grad_(True)
    tb = teacher.bfloat16()
    kl, nll = linear_head_losses(hb, wb, targets, tb, token_block=16, vocab_block=64)
    assert kl.dtype == nll.dtype == torch.float32
    ref_kl, ref_nll = linear_head_losses_reference(hb, wb, targets, tb)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(nll, ref_nll, rtol=1e-4, atol=1e-3)
    got, want = _grads(kl + nll, hb, wb), _grads(ref_kl + ref_nll, hb, wb)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_every_target_ignored_gives_zero_and_no_gradient_from_it():
    hidden, weight, _, _, _ = _inputs(5, 9, 4, 4)
    targets = torch.full((5,), IGNORE_INDEX)
    kl, nll = linear_head_losses(hidden, weight, targets, None, token_block=2, vocab_block=4)
    assert float(nll.detach()) == 0.0 and float(kl.detach()) == 0.0
    gh, gw = _grads(nll, hidden, weight)
    assert not gh.any() and not gw.any()


def test_frozen_weight_gets_no_gradient_and_teacher_none():
    hidden, weight, _, teacher, targets = _inputs(5, 9, 4, 5)
    weight = weight.detach()
    kl, nll = linear_head_losses(hidden, weight, targets, teacher, token_block=2, vocab_block=4)
    (kl + nll).backward()
    assert hidden.grad is not None and weight.grad is None and not teacher.requires_grad


def test_kl_of_a_head_to_itself_is_zero():
    hidden, weight, _, _, _ = _inputs(6, 20, 4, 6)
    kl, _ = linear_head_losses(hidden, weight, None, hidden.detach(), token_block=4, vocab_block=3)
    assert abs(float(kl)) < 1e-10


@pytest.mark.parametrize(
    "shapes",
    [((4, 3), (10, 3), (5,)), ((4,), (10, 4), (4,)), ((2, 4), (10, 3), (2,))],
)
def test_bad_shapes_are_refused(shapes):
    h, w, y = shapes
    with pytest.raises(ValueError, match="expected"):
        linear_head_losses(torch.randn(h), torch.randn(w), torch.zeros(y, dtype=torch.long))


def test_bad_teacher_blocks_and_targets_are_refused():
    h, w = torch.randn(2, 3), torch.randn(4, 3)
    with pytest.raises(ValueError, match="teacher"):
        linear_head_losses(h, w, None, torch.randn(3, 3))
    with pytest.raises(ValueError, match="positive"):
        linear_head_losses(h, w, torch.zeros(2, dtype=torch.long), vocab_block=0)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 4\)"):
        linear_head_losses(h, w, torch.tensor([1, 4]))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 4\)"):
        linear_head_losses(h, w, torch.tensor([1, -3]))


def test_dense_reference_is_transformers_loss():
    """The reference's nll over valid targets / their count is F.cross_entropy's mean (ignore_index)."""
    hidden, weight, _, _, targets = _inputs(9, 30, 4, 7, ignore=0.4, dtype=torch.float32)
    targets[0] = 3  # at least one scored
    _, nll = linear_head_losses_reference(hidden, weight, targets)
    want = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(nll / (targets != IGNORE_INDEX).sum(), want)
