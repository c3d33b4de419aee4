"""gqa_sdpa: grouped-query SDPA against repeated key/value heads, forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retrofit.ops import gqa_sdpa
from retrofit.ops.sdpa import native_gqa_on_cuda


def _reference(q, k, v, mask=None, causal=False, scale=None):
    """Every key/value head repeated for its query heads, then the math kernel in fp64."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v.double()).to(q.dtype)


@pytest.mark.parametrize("heads", [(6, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("form", ["causal", "mask"])
def test_matches_repeated_heads_forward_and_backward(heads, form):
    torch.manual_seed(0)
    (hq, hkv), T, D = heads, 37, 16
    q = torch.randn(2, hq, T, D, requires_grad=True)
    k = (torch.randn(2, hkv, T, D) * 4).requires_grad_()  # large logits
    v = torch.randn(2, hkv, T, D, requires_grad=True)
    mask = None
    if form == "mask":  # padding in the first row: its first 5 keys are never seen
        mask = torch.ones(2, 1, T, T, dtype=torch.bool).tril()
        mask[0, :, :, :5] = False
        mask[0, :, :5, 0] = True  # ... except by the padded queries themselves (no empty rows)
    out = gqa_sdpa(q, k, v, attn_mask=mask, is_causal=form == "causal", scale=0.3)
    ref = _reference(q, k, v, mask, form == "causal", scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((out * ref.detach().cos()).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * ref.detach().cos()).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_bf16_matches_fp32_on_the_same_inputs():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, h, 64, 32).bfloat16() for h in (9, 3, 3))
    out = gqa_sdpa(q, k, v, is_causal=True)
    ref = _reference(q.float(), k.float(), v.float(), causal=True)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_heads_must_divide():
    with pytest.raises(ValueError, match="multiple"):
        gqa_sdpa(torch.randn(1, 5, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))


@pytest.mark.parametrize("dtype, head_dim, masked, native", [
    (torch.bfloat16, 64, False, True), (torch.float16, 256, False, True),
    (torch.float32, 64, False, False),  # fp32: only the math kernel broadcasts kv heads
    (torch.bfloat16, 64, True, False),  # a mask: likewise
    (torch.bfloat16, 512, False, False),  # beyond the fused kernels' head dim
])
def test_the_cuda_kernel_choice(dtype, head_dim, masked, native):
    assert native_gqa_on_cuda(dtype, head_dim, masked) is native


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_runs_without_the_math_kernel(dtype, masked):
    """With the math kernel switched off, SDPA itself refuses fp32 or masked GQA; gqa_sdpa runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(2)
    q, k, v = (torch.randn(2, h, 512, 64, device="cuda", dtype=dtype) for h in (9, 3, 3))
    mask = torch.ones(2, 1, 512, 512, device="cuda", dtype=torch.bool).tril() if masked else None
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        out = gqa_sdpa(q, k, v, attn_mask=mask, is_causal=not masked)
    ref = _reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), None if mask is None else mask.cpu(), not masked)
    tol = 5e-3 if dtype == torch.float32 else 2e-2
    assert ((out.float().cpu() - ref).norm() / ref.norm()).item() < tol
