"""GPU backends against the torch reference ops, forward and backward, fp32 and bf16.

Skipped without CUDA (conftest's ``cuda`` marker) and per backend without its package
(flash-linear-attention for ``fla``, flash-attn for ``flash``; flex needs torch >= 2.5).
Tolerances: bf16 inputs are compared with the torch op run in fp32 on the same bf16-rounded
inputs, by relative error of the whole tensor (||a - b|| / ||b||, ||b|| floored at an RMS of
1e-3 for gradients that vanish analytically, e.g. d/dk at T = 1); fla's fp32 path uses
Triton dots (TF32 on Ampere+), hence its looser fp32 bound.
"""
from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

import retrofit.ops as ops
from retrofit.ops import LatteState, backends, macchiato_attention, sliding_window_attention_reference
# the torch kernels themselves (no dispatch): the references the GPU backends are compared with
from retrofit.ops.exp_linear import exp_linear_attention, exp_linear_attention_step
from retrofit.ops.latte import causal_latte_chunked, causal_latte_step
from tests.ops._inputs import padding_mask

pytestmark = pytest.mark.cuda

needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
needs_flash = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed")
needs_flex = pytest.mark.skipif(
    importlib.util.find_spec("torch.nn.attention.flex_attention") is None, reason="torch has no flex attention"
)

DEV = "cuda"
TOL = {torch.float32: 5e-3, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, with ||b|| floored at an RMS of 1e-3 (gradients that are 0 analytically)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-3 * b.numel() ** 0.5)).item()


def _run(fn, inputs, *, extra_loss=None):
    """Forward + backward with a fixed random cotangent; returns (out, grads, aux)."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out, aux = fn(*xs)
    gen = torch.Generator(device=out.device).manual_seed(1)
    cot = torch.randn(out.shape, device=out.device, generator=gen, dtype=torch.float32)
    loss = (out.float() * cot).sum()
    if extra_loss is not None:
        loss = loss + extra_loss(aux)
    loss.backward()
    return out.detach(), [x.grad for x in xs if x.requires_grad], aux


def _compare(got, ref, dtype):
    (o1, g1, _), (o2, g2, _) = got, ref
    assert _rel(o1, o2) < TOL[dtype], f"output rel err {_rel(o1, o2)}"
    for a, b in zip(g1, g2):
        assert torch.isfinite(a).all()
        assert _rel(a, b) < 2 * TOL[dtype], f"grad rel err {_rel(a, b)}"


def _latte_inputs(B, H, T, L, D, dtype):
    q = torch.softmax(torch.randn(B, H, T, L, device=DEV), -1).to(dtype)
    k = (torch.randn(B, H, T, L, device=DEV) * 3).to(dtype)
    v = torch.randn(B, H, T, D, device=DEV).to(dtype)
    return q, k, v


# --------------------------------------------------------------------------------------
# fla


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 63, 200, 1000])
@pytest.mark.parametrize("padded", [False, True])
def test_fla_latte_chunked_matches_torch(dtype, T, padded):
    B, H, L, D = 2, 4, 16, 64
    q, k, v = _latte_inputs(B, H, T, L, D, dtype)
    mask = padding_mask(B, T, [0, min(5, T - 1)]).to(DEV) if padded else None

    def fla(q, k, v):
        return ops.causal_latte_chunked(q, k, v, key_padding_mask=mask, output_final_state=True, backend="fla")

    def ref(q, k, v):  # fp32 torch op on the same (rounded) inputs
        out, st = causal_latte_chunked(q.float(), k.float(), v.float(), key_padding_mask=mask, output_final_state=True)
        return out, st

    state_loss = lambda st: (st.m.float() * 0.1).sum()  # noqa: E731 - exercises fla's dht path
    got, want = _run(fla, (q, k, v), extra_loss=state_loss), _run(ref, (q, k, v), extra_loss=state_loss)
    _compare(got, want, dtype)
    assert _rel(got[2].m, want[2].m) < TOL[dtype]
    torch.testing.assert_close(got[2].z, want[2].z, atol=1e-4, rtol=1e-4)


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_latte_continues_from_a_state_and_steps(dtype):
    B, H, L, D = 2, 4, 16, 64
    q, k, v = _latte_inputs(B, H, 300, L, D, dtype)
    _, state = causal_latte_chunked(q[:, :, :200].float(), k[:, :, :200].float(), v[:, :, :200].float(), output_final_state=True)
    out, st = ops.causal_latte_chunked(
        q[:, :, 200:], k[:, :, 200:], v[:, :, 200:], initial_state=state, output_final_state=True, backend="fla"
    )
    ref, ref_st = causal_latte_chunked(
        q[:, :, 200:].float(), k[:, :, 200:].float(), v[:, :, 200:].float(), initial_state=state, output_final_state=True
    )
    assert _rel(out, ref) < TOL[dtype] and _rel(st.m, ref_st.m) < TOL[dtype]

    valid = torch.tensor([True, False], device=DEV)
    o1, s1 = ops.causal_latte_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state, valid=valid, backend="fla")
    o2, s2 = causal_latte_step(q[:, :, 0].float(), k[:, :, 0].float(), v[:, :, 0].float(), state, valid=valid)
    assert _rel(o1[0], o2[0]) < TOL[dtype] and (o1[1] == 0).all()
    assert _rel(s1.m, s2.m) < TOL[dtype]
    torch.testing.assert_close(s1.m[1], state.m[1])  # the padded row keeps its state
    torch.testing.assert_close(s1.z, s2.z)


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_exp_linear_matches_torch(dtype):
    B, H, T, d = 2, 4, 257, 64
    q, k, v = (torch.randn(B, H, T, d, device=DEV).to(dtype) for _ in range(3))
    fla = lambda q, k, v: ops.exp_linear_attention(q, k, v, output_final_state=True, backend="fla")  # noqa: E731
    ref = lambda q, k, v: exp_linear_attention(q.float(), k.float(), v.float(), output_final_state=True)  # noqa: E731
    got, want = _run(fla, (q, k, v)), _run(ref, (q, k, v))
    _compare(got, want, dtype)
    o1, _ = ops.exp_linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], got[2], backend="fla")
    o2, _ = exp_linear_attention_step(q[:, :, 0].float(), k[:, :, 0].float(), v[:, :, 0].float(), want[2])
    assert _rel(o1, o2) < TOL[dtype]


@needs_fla
def test_fla_latte_survives_large_logit_spread():
    q, k, v = _latte_inputs(1, 2, 512, 16, 64, torch.bfloat16)
    k = (k.float() * 30).to(torch.bfloat16)  # spreads of hundreds inside a chunk
    out, _ = ops.causal_latte_chunked(q, k, v, backend="fla")
    ref, _ = causal_latte_chunked(q.float(), k.float(), v.float())
    assert torch.isfinite(out).all() and _rel(out, ref) < TOL[torch.bfloat16]


# --------------------------------------------------------------------------------------
# flash-attn and flex


def _swa_inputs(B, Hq, Hkv, T, d, dtype, num_past=0):
    q = torch.randn(B, Hq, T, d, device=DEV).to(dtype)
    k = torch.randn(B, Hkv, T + num_past, d, device=DEV).to(dtype)
    v = torch.randn(B, Hkv, T + num_past, d, device=DEV).to(dtype)
    return q, k, v


@needs_flash
@pytest.mark.parametrize("T,window", [(100, 16), (1000, 128), (777, 128)])
@pytest.mark.parametrize("softcap", [None, 50.0])
@pytest.mark.parametrize("gqa", [1, 4])
def test_flash_sliding_window_matches_reference(T, window, softcap, gqa):
    dtype = torch.bfloat16
    q, k, v = _swa_inputs(2, 8, 8 // gqa, T, 128, dtype)
    kw = dict(softcap=softcap, scaling=0.07)
    flash = lambda q, k, v: (ops.sliding_window_attention(q, k, v, window, backend="flash", **kw), None)  # noqa: E731
    ref = lambda q, k, v: (sliding_window_attention_reference(q.float(), k.float(), v.float(), window, **kw), None)  # noqa: E731
    _compare(_run(flash, (q, k, v)), _run(ref, (q, k, v)), dtype)


@needs_flash
@pytest.mark.parametrize("num_past", [1, 50, 300])
def test_flash_sliding_window_with_cached_keys(num_past):
    q, k, v = _swa_inputs(2, 8, 2, 7, 64, torch.bfloat16, num_past=num_past)
    out = ops.sliding_window_attention(q, k, v, 128, num_past=num_past, backend="flash")
    ref = sliding_window_attention_reference(q.float(), k.float(), v.float(), 128, num_past=num_past)
    assert _rel(out, ref) < TOL[torch.bfloat16]
    off = sliding_window_attention_reference(q.float(), k.float(), v.float(), 127, num_past=num_past)
    if num_past >= 127:  # the off-by-one matters only once the window is full
        assert _rel(out, off) > 2 * TOL[torch.bfloat16]


@needs_flex
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_flex_sliding_window_matches_reference(dtype, padded):
    q, k, v = _swa_inputs(2, 8, 2, 600, 64, dtype)
    mask = padding_mask(2, 600, [0, 33]).to(DEV) if padded else None
    kw = dict(softcap=30.0, key_padding_mask=mask)
    flex = lambda q, k, v: (ops.sliding_window_attention(q, k, v, 128, backend="flex", **kw), None)  # noqa: E731
    ref = lambda q, k, v: (sliding_window_attention_reference(q.float(), k.float(), v.float(), 128, **kw), None)  # noqa: E731
    _compare(_run(flex, (q, k, v)), _run(ref, (q, k, v)), dtype)


# --------------------------------------------------------------------------------------
# the full Macchiato op and auto dispatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_macchiato_auto_matches_torch(dtype, caplog):
    B, Hq, Hkv, T, d, L = 2, 8, 2, 700, 128, 16
    q, k, v = _swa_inputs(B, Hq, Hkv, T, d, dtype)
    mix = torch.randn(B, Hq, T, L + 1, device=DEV).to(dtype)
    lat = (torch.randn(B, Hq, T, L, device=DEV) * 3).to(dtype)
    caplog.set_level(logging.INFO, logger="retrofit.ops.backends")
    backends._reset_log_memory()
    auto = lambda *x: macchiato_attention(*x, window=128, softcap=50.0)  # noqa: E731
    ref = lambda *x: macchiato_attention(*(t.float() for t in x), window=128, softcap=50.0, backend="torch")  # noqa: E731
    _compare(_run(auto, (q, k, v, mix, lat)), _run(ref, (q, k, v, mix, lat)), dtype)
    ran = " ".join(r.getMessage() for r in caplog.records)
    if dtype == torch.bfloat16 and backends.is_installed("fla"):
        assert "causal_latte_chunked runs on the fla backend" in ran
    if dtype == torch.bfloat16 and backends.is_installed("flash"):
        assert "sliding_window_attention runs on the flash backend" in ran
    if dtype == torch.float32:
        assert "runs on the torch backend" in ran


def test_empty_state_roundtrip_on_cuda():
    st = LatteState.empty(1, 2, 3, 4, device=DEV)
    q, k, v = _latte_inputs(1, 2, 5, 3, 4, torch.bfloat16)
    out, _ = ops.causal_latte_chunked(q, k, v, initial_state=st)
    ref, _ = causal_latte_chunked(q.float(), k.float(), v.float())
    assert _rel(out, ref) < TOL[torch.bfloat16]
