"""Blocked LM-head cross-entropy against the dense logits + cross-entropy it replaces."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from retrofit.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference


def _loop_reference(hidden, weight, targets, bias, softcap):
    """Independent fp64 evaluation, one position at a time: -log softmax(z)[y]."""
    out = []
    for h, y in zip(hidden.double(), targets):
        z = weight.double() @ h + (0 if bias is None else bias.double())
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        out.append(torch.logsumexp(z, 0) - z[y])
    return torch.stack(out)


@settings(max_examples=25, deadline=None)
@given(
    N=st.integers(1, 40),
    V=st.integers(1, 70),
    D=st.integers(1, 9),
    token_block=st.integers(1, 17),
    vocab_block=st.integers(1, 23),
    with_bias=st.booleans(),
    softcap=st.sampled_from([None, 0.5, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_blocked_matches_definition(N, V, D, token_block, vocab_block, with_bias, softcap, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    want = _loop_reference(hidden, weight, targets, bias, softcap)
    got = linear_cross_entropy(
        hidden, weight, targets, bias=bias, softcap=softcap, token_block=token_block, vocab_block=vocab_block
    )
    ref = linear_cross_entropy_reference(hidden, weight, targets, bias=bias, softcap=softcap)
    assert got.dtype == torch.float32 and got.shape == (N,)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)


def test_targets_on_every_block_boundary():
    V, vb = 64, 8
    weight = torch.randn(V, 5)
    targets = torch.tensor([0, vb - 1, vb, 2 * vb - 1, V - 1, V - vb])
    hidden = torch.randn(len(targets), 5)
    got = linear_cross_entropy(hidden, weight, targets, token_block=4, vocab_block=vb)
    torch.testing.assert_close(got, linear_cross_entropy_reference(hidden, weight, targets))


def test_large_logits_do_not_overflow():
    """Logits of +-1e4 (exp overflows fp32 a hundred times over): the running log-sum-exp stays exact."""
    weight = torch.randn(300, 16)
    hidden = torch.randn(12, 16) * 3e3
    targets = torch.randint(0, 300, (12,))
    got = linear_cross_entropy(hidden, weight, targets, token_block=5, vocab_block=7)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _loop_reference(hidden, weight, targets, None, None), rtol=1e-5, atol=1e-2)


def test_bf16_head_matches_its_own_logits():
    """A bf16 head: the matmul runs in bf16 as the model's does, the reduction in fp32."""
    weight = torch.randn(500, 32).bfloat16()
    hidden = torch.randn(20, 32).bfloat16()
    targets = torch.randint(0, 500, (20,))
    got = linear_cross_entropy(hidden, weight, targets, token_block=6, vocab_block=64)
    want = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_float32_hidden_with_bf16_weight_is_cast_like_the_head():
    weight = torch.randn(50, 8).bfloat16()
    hidden = torch.randn(3, 8)
    targets = torch.tensor([1, 2, 3])
    got = linear_cross_entropy(hidden, weight, targets)
    want = F.cross_entropy(F.linear(hidden.bfloat16(), weight).float(), targets, reduction="none")
    torch.testing.assert_close(got, want)


def test_runs_without_building_a_graph():
    weight = torch.randn(30, 4, requires_grad=True)
    out = linear_cross_entropy(torch.randn(5, 4), weight, torch.zeros(5, dtype=torch.long))
    assert not out.requires_grad


@pytest.mark.parametrize(
    "shapes",
    [((4, 3), (10, 3), (5,)), ((4,), (10, 4), (4,)), ((2, 4), (10, 3), (2,))],
)
def test_bad_shapes_are_refused(shapes):
    h, w, y = shapes
    with pytest.raises(ValueError, match="expected hidden"):
        linear_cross_entropy(torch.randn(h), torch.randn(w), torch.zeros(y, dtype=torch.long))


def test_bad_block_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), torch.zeros(2, dtype=torch.long), vocab_block=0)


@pytest.mark.parametrize("bad", [-100, 4])
def test_targets_outside_the_vocabulary_are_refused(bad):
    """No ignore_index: a -100 label would otherwise be scored against a logit of 0."""
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 4\)"):
        linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([1, bad]))
