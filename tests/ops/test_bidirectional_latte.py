"""Bidirectional Latte (Definition 1): O(T L D) form against the materialised T x T matrix."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from retrofit.ops import bidirectional_latte, bidirectional_latte_reference
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import padding_mask


def test_matches_reference_and_rows_are_distributions():
    q = torch.randn(2, 3, 40, 6, dtype=torch.float64) * 5
    k = torch.randn(2, 3, 40, 6, dtype=torch.float64) * 5
    v = torch.randn(2, 3, 40, 4, dtype=torch.float64)
    mask = padding_mask(2, 40, [0, 7])
    torch.testing.assert_close(bidirectional_latte(q, k, v, key_padding_mask=mask), bidirectional_latte_reference(q, k, v, key_padding_mask=mask))
    ones = bidirectional_latte(q, k, torch.ones_like(v), key_padding_mask=mask)
    torch.testing.assert_close(ones[1, :, 7:], torch.ones_like(ones[1, :, 7:]))


def test_sees_the_future():
    q, k, v = (torch.randn(1, 1, 10, 3, dtype=torch.float64) for _ in range(3))
    out = bidirectional_latte(q, k, v)
    v2 = v.clone()
    v2[:, :, -1] += 10
    assert not torch.allclose(out[:, :, 0], bidirectional_latte(q, k, v2)[:, :, 0])


def test_gradcheck_and_large_logits():
    args = [torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    assert gradcheck(bidirectional_latte, args)
    big = bidirectional_latte(torch.randn(1, 1, 50, 4) * 500, torch.randn(1, 1, 50, 4) * 500, torch.randn(1, 1, 50, 4))
    assert torch.isfinite(big).all()


def _by_definition(q_logits, k_logits, v, mask):
    """Definition 1 written out with plain exponentials, row by row: p(l|t) = exp(q_tl) / sum_l' exp(q_tl'),
    p(s|l) = exp(a_sl) / sum_{s' real} exp(a_s'l) over the real tokens only, o_t = sum_l p(l|t) sum_s p(s|l) v_s;
    padded queries output 0. Shifts by the maxima keep the exponentials finite."""
    B, H, T, L = q_logits.shape
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        real = mask[b].nonzero().squeeze(-1)
        for h in range(H):
            a = k_logits[b, h, real]  # (S, L)
            e = torch.exp(a - a.max(0).values)
            summary = (e / e.sum(0)).T @ v[b, h, real]  # (L, D): sum_s p(s|l) v_s
            eq = torch.exp(q_logits[b, h, real] - q_logits[b, h, real].max(-1, keepdim=True).values)
            out[b, h, real] = (eq / eq.sum(-1, keepdim=True)) @ summary
    return out


@pytest.mark.parametrize("scale", [1.0, 60.0])
def test_values_and_gradients_match_the_definition_with_padding(scale):
    """300 tokens, rows padded on the left, logits of up to hundreds of nats: values and the gradients
    of q, k and v against autograd through the definition evaluated row by row."""
    q = torch.randn(3, 2, 300, 5, dtype=torch.float64) * scale
    k = torch.randn(3, 2, 300, 5, dtype=torch.float64) * scale
    v = torch.randn(3, 2, 300, 4, dtype=torch.float64)
    mask = padding_mask(3, 300, [0, 41, 299])
    assert_values_and_grads_match(
        lambda q, k, v: bidirectional_latte(q, k, v, key_padding_mask=mask),
        lambda q, k, v: _by_definition(q, k, v, mask),
        (q, k, v),
    )
