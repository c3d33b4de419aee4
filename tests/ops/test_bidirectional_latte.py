"""Bidirectional Latte (Definition 1): O(T L D) form against the materialised T x T matrix."""
from __future__ import annotations

import torch
from torch.autograd import gradcheck

from retrofit.ops import bidirectional_latte, bidirectional_latte_reference
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
