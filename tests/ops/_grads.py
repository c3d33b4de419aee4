"""Forward and backward of an op against an independent reference, in one call."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def assert_values_and_grads_match(
    op: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    atol: float = 1e-10,
    rtol: float = 1e-10,
    seed: int = 0,
) -> None:
    """``op(*inputs)`` equals ``reference(*inputs)``, and so does the gradient of every input.

    Both run on their own leaf copies of ``inputs`` and are pulled back with one random cotangent
    (every output element weighted differently, so no gradient cancels by symmetry). Every input
    must receive a gradient from both; none of them may be all zero.
    """
    outs, grads = [], []
    for fn in (op, reference):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        (out.double() * cotangent).sum().backward()
        outs.append(out.detach().double())
        grads.append([x.grad for x in leaves])
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=rtol, msg=lambda m: f"values: {m}")
    for i, (got, want) in enumerate(zip(*grads)):
        assert got is not None and want is not None, f"input {i} received no gradient"
        assert want.abs().max() > 0, f"input {i}: the reference's gradient is zero (the test would prove nothing)"
        torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol, msg=lambda m, i=i: f"gradient of input {i}: {m}")
