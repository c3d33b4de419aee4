"""Backend dispatch on CPU: the choice logic, the log lines, and the GPU paths' math that runs on CPU.

The kernels themselves are compared in test_backends_cuda.py (skipped without CUDA). Here:
* which backend runs (auto -> torch on CPU; argument > set_default_backend > env var),
* requested-but-impossible backends fall back to torch with one warning,
* the gate mapping onto GLA (fla's recurrence, written out in fp64) reproduces causal Latte,
* the flex-attention sliding window (eager on CPU) reproduces the reference, off-by-one included.
"""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from retrofit.errors import SpecError
import retrofit.ops as ops
from retrofit.ops import (
    LatteState,
    backends,
    causal_latte_reference,
    exp_linear_attention_reference,
    sliding_window_attention_reference,
)
from retrofit.ops.backends import registry
import retrofit.ops.backends.fla as fla_backend
from retrofit.ops.backends.fla import gla_inputs
from retrofit.ops.delta_rule import delta_rule_reference
# the torch kernels themselves (no dispatch)
from retrofit.ops.exp_linear import exp_linear_attention, exp_linear_weights
from retrofit.ops.latte import causal_latte_chunked
from retrofit.ops.sliding_window import sliding_window_attention
from tests.ops._inputs import latte_inputs, padding_mask

LOGGER = "retrofit.ops.backends"
_IS_INSTALLED = backends.is_installed  # the cached original (one test swaps it out)


@pytest.fixture(autouse=True)
def _clean_dispatch_state(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.set_default_backend(None)
    backends._reset_log_memory()
    yield
    backends.set_default_backend(None)
    backends._reset_log_memory()
    _IS_INSTALLED.cache_clear()


def _block_import(monkeypatch, *modules: str) -> None:
    """Make ``import <module>`` fail as if the package were not installed."""
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)
    _IS_INSTALLED.cache_clear()


# --------------------------------------------------------------------------------------
# choosing


@pytest.mark.parametrize("op", ["causal_latte_chunked", "sliding_window_attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_picks_torch_on_cpu(op, dtype):
    assert backends.resolve_backend(op, "cpu", dtype) == "torch"
    assert backends.resolve_backend(op, "cpu", dtype, "auto") == "torch"


def test_ops_on_cpu_equal_the_torch_kernels():
    q, k, v = latte_inputs(2, 3, 40, 4, 5, dtype=torch.float32)
    out, state = ops.causal_latte_chunked(q, k, v, chunk_size=16, output_final_state=True)
    ref, ref_state = causal_latte_chunked(q, k, v, chunk_size=16, output_final_state=True)
    assert torch.equal(out, ref) and torch.equal(state.m, ref_state.m) and torch.equal(state.z, ref_state.z)

    qq, kk, vv = (torch.randn(2, 4, 40, 8) for _ in range(3))
    assert torch.equal(ops.sliding_window_attention(qq, kk, vv, 8), sliding_window_attention(qq, kk, vv, 8))
    out, _ = ops.exp_linear_attention(qq, kk, vv)
    assert torch.equal(out, exp_linear_attention(qq, kk, vv)[0])


def test_override_precedence(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert backends.get_default_backend() == "torch"
    backends.set_default_backend("fla,flash")
    assert backends.get_default_backend() == "fla,flash"  # set_default_backend beats the env var
    with backends.use_backend("torch"):
        assert backends.get_default_backend() == "torch"
    assert backends.get_default_backend() == "fla,flash"
    backends.set_default_backend("auto")
    assert backends.get_default_backend() == "torch"  # cleared: the env var again


def test_explicit_torch_is_honoured_and_logged_once(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    q, k, v = latte_inputs(1, 2, 10, 3, 4, dtype=torch.float32)
    for _ in range(3):
        ops.causal_latte_chunked(q, k, v, backend="torch")
    ran = [r for r in caplog.records if "runs on the torch backend" in r.getMessage()]
    assert len(ran) == 1 and ran[0].levelno == logging.INFO
    assert "causal_latte_chunked" in ran[0].getMessage() and "float32" in ran[0].getMessage()


def test_env_var_request_reaches_the_wrappers(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setenv(backends.ENV_VAR, "fla")
    q, k, v = latte_inputs(1, 2, 10, 3, 4, dtype=torch.float32)
    out, _ = ops.causal_latte_chunked(q, k, v)  # fla asked for, CPU tensors: torch, with a warning
    torch.testing.assert_close(out, causal_latte_chunked(q, k, v)[0])
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "requested the fla backend" in msgs[0] and "CUDA" in msgs[0]


@pytest.mark.parametrize("backend,module", [("fla", "fla"), ("flash", "flash_attn")])
def test_missing_package_falls_back_to_torch(monkeypatch, caplog, backend, module):
    _block_import(monkeypatch, module)
    assert backends.is_installed(backend) is False
    op = "causal_latte_chunked" if backend == "fla" else "sliding_window_attention"
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    # a CUDA device with a half dtype passes every other check: only the package is missing
    assert backends.resolve_backend(op, "cuda", torch.bfloat16, backend) == "torch"
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "not installed" in warn[0]
    caplog.clear()
    assert backends.resolve_backend(op, "cuda", torch.bfloat16) == "torch"  # auto: quiet fallback
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("not installed" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_comma_list_applies_per_op(monkeypatch):
    _block_import(monkeypatch, "fla", "flash_attn")
    backends.set_default_backend("fla,torch")
    # fla is the latte request (impossible here -> torch); torch is the window request
    assert backends.resolve_backend("causal_latte_chunked", "cuda", torch.bfloat16) == "torch"
    assert backends.resolve_backend("sliding_window_attention", "cuda", torch.bfloat16) == "torch"


def test_auto_rules_for_cuda_tensors(monkeypatch):
    # eligibility on a CUDA device, independent of what is installed on this machine
    monkeypatch.setattr(registry, "is_installed", lambda b: True)
    dev = torch.device("cuda")
    swa = dict(head_dim=128, value_dim=128)
    assert backends.resolve_backend("causal_latte_chunked", dev, torch.bfloat16) == "fla"
    assert backends.resolve_backend("causal_latte_chunked", dev, torch.float32) == "torch"  # TF32 only on request
    assert backends.resolve_backend("causal_latte_chunked", dev, torch.float32, "fla") == "fla"
    assert backends.resolve_backend("causal_latte_step", dev, torch.bfloat16) == "torch"  # launch-bound: torch step
    assert backends.resolve_backend("causal_latte_step", dev, torch.bfloat16, "fla") == "fla"
    assert backends.resolve_backend("causal_latte_chunked", dev, torch.float64, "fla") == "torch"
    assert backends.resolve_backend("sliding_window_attention", dev, torch.bfloat16, **swa) == "flash"
    assert backends.resolve_backend("sliding_window_attention", dev, torch.float32, **swa) == "torch"
    assert backends.resolve_backend("sliding_window_attention", dev, torch.bfloat16, key_padding_mask=True, **swa) == "torch"
    assert backends.resolve_backend("sliding_window_attention", dev, torch.bfloat16, head_dim=512, value_dim=512) == "torch"
    assert backends.resolve_backend("sliding_window_attention", dev, torch.float32, "flex", **swa) == "flex"
    assert backends.resolve_backend("causal_latte_chunked", dev, torch.bfloat16, "flash") == "fla"  # flash says nothing about latte


def test_delta_rule_on_fla_is_on_request_and_falls_back_where_its_backward_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(registry, "is_installed", lambda b: True)
    dev = torch.device("cuda")
    assert backends.resolve_backend("delta_rule_chunked", dev, torch.bfloat16) == "torch"  # auto: torch
    assert backends.resolve_backend("delta_rule_chunked", dev, torch.bfloat16, "fla", needs_grad=True) == "fla"
    monkeypatch.setattr(fla_backend, "delta_backward_refused", lambda: "fla refuses it here")
    backends._reset_log_memory()  # the choice above is remembered per call description
    assert backends.resolve_backend("delta_rule_chunked", dev, torch.bfloat16, "fla") == "fla"  # no backward: fla
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert backends.resolve_backend("delta_rule_chunked", dev, torch.bfloat16, "fla", needs_grad=True) == "torch"
    assert "requested the fla backend but fla refuses it here; using torch" in caplog.text
    with backends.strict_backends(), pytest.raises(backends.BackendUnavailable, match="fla refuses it here"):
        backends.resolve_backend("delta_rule_chunked", dev, torch.bfloat16, "fla", needs_grad=True)


def test_delta_call_says_whether_autograd_will_differentiate_it():
    q, v, beta = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.rand(1, 1, 3)
    describe = ops.delta_rule_chunked.describe
    assert not describe(q, q, v, beta).needs_grad
    assert describe(q, q, v, beta.requires_grad_()).needs_grad
    with torch.no_grad():
        assert not describe(q, q, v, beta).needs_grad


def _fake_fla_flags(monkeypatch, *, hopper, triton_3_4, triton_3_7_1, tilelang):
    import types

    env = types.SimpleNamespace(TRITON_ABOVE_3_4_0=triton_3_4, TRITON_ABOVE_3_7_1=triton_3_7_1)
    utils = types.ModuleType("fla.utils")
    utils.env, utils.hardware = env, types.SimpleNamespace(IS_NVIDIA_HOPPER=hopper)
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.utils", utils)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(fla_backend.importlib.util, "find_spec", lambda name: object() if tilelang else None)
    fla_backend.delta_backward_refused.cache_clear()


@pytest.mark.parametrize("hopper,triton_3_4,triton_3_7_1,tilelang,refused", [
    (True, True, False, False, True),     # the miscompile fla guards against
    (True, True, True, False, False),     # Triton >= 3.7.1
    (True, False, False, False, False),   # Triton < 3.4
    (False, True, False, False, False),   # not Hopper
    (True, True, False, True, False),     # tilelang runs that kernel instead
])
def test_delta_backward_refusal_follows_flas_own_flags(monkeypatch, hopper, triton_3_4, triton_3_7_1, tilelang, refused):
    _fake_fla_flags(monkeypatch, hopper=hopper, triton_3_4=triton_3_4, triton_3_7_1=triton_3_7_1, tilelang=tilelang)
    try:
        reason = fla_backend.delta_backward_refused()
    finally:
        fla_backend.delta_backward_refused.cache_clear()
    assert (reason is not None) == refused
    if refused:
        assert "Triton 3.6.0" in reason and "3.7.1" in reason


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(SpecError, match="unknown attention backend 'triton'"):
        backends.resolve_backend("causal_latte_chunked", "cpu", torch.float32, "triton")
    with pytest.raises(SpecError):
        backends.set_default_backend("cuda")


# --------------------------------------------------------------------------------------
# the GLA mapping (fla path) without fla: GLA's recurrence written out in fp64


def _naive_gla(q, k, v, g, h0):
    """fla's GLA semantics, [B, T, H, K] layout, scale 1: S_t = diag(exp g_t) S_{t-1} + k_t v_t^T."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if h0 is None else h0.double()
    outs = []
    for t in range(T):
        S = S * g[:, t].double().exp()[..., None] + k[:, t].double()[..., None] * v[:, t].double()[..., None, :]
        outs.append((q[:, t].double()[..., None] * S).sum(-2))
    return torch.stack(outs, dim=2), S  # out (B, H, T, D)


def test_gla_mapping_reproduces_causal_latte():
    q, a, v = latte_inputs(2, 3, 29, 4, 5, spread=10.0)
    mask = padding_mask(2, 29, [0, 6])
    gq, gk, gv, gg, h0, z_last = gla_inputs(q, a, v, key_padding_mask=mask, dtype=torch.float64)
    assert h0 is None and (gg <= 0).all() and torch.isfinite(gg).all() and (gk >= 0).all() and (gk <= 1).all()
    out, S = _naive_gla(gq, gk, gv, gg, h0)
    out = out * mask[:, None, :, None]
    torch.testing.assert_close(out, causal_latte_reference(q, a, v, key_padding_mask=mask), atol=1e-12, rtol=1e-10)
    _, state = causal_latte_chunked(q, a, v, key_padding_mask=mask, output_final_state=True)
    torch.testing.assert_close(S, state.m, atol=1e-12, rtol=1e-10)  # GLA's state is our normalised m
    torch.testing.assert_close(z_last, state.z)

    # continuing from a state: g_1 = z_init - z_1 (fla's h0 is fp32, hence the tolerance)
    q2, a2, v2 = latte_inputs(2, 3, 11, 4, 5, spread=10.0)
    ref2, state2 = causal_latte_chunked(q2, a2, v2, initial_state=state, output_final_state=True)
    gq, gk, gv, gg, h0, z_last = gla_inputs(q2, a2, v2, initial_state=state, dtype=torch.float64)
    assert h0.dtype == torch.float32 and (gg[:, 0] < 0).any()
    out, S = _naive_gla(gq, gk, gv, gg, h0)
    torch.testing.assert_close(out, ref2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(S, state2.m, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(z_last, state2.z)


def test_gla_mapping_with_empty_state_and_leading_padding():
    q, a, v = latte_inputs(2, 1, 9, 3, 2)
    mask = padding_mask(2, 9, [3, 9])  # the second row is all padding
    empty = LatteState.empty(2, 1, 3, 2, dtype=torch.float64)
    gq, gk, gv, gg, h0, z_last = gla_inputs(q, a, v, key_padding_mask=mask, initial_state=empty, dtype=torch.float64)
    assert torch.isfinite(gg).all() and torch.isfinite(gk).all()
    out, _ = _naive_gla(gq, gk, gv, gg, h0)
    ref = causal_latte_reference(q, a, v, key_padding_mask=mask)
    torch.testing.assert_close(out * mask[:, None, :, None], ref)
    assert torch.isinf(z_last[1]).all()


def test_exp_linear_mapping_reproduces_the_reference():
    q, k, v = (torch.randn(2, 2, 23, 6, dtype=torch.float64) for _ in range(3))
    mask = padding_mask(2, 23, [0, 4])
    p, a = exp_linear_weights(q, k * 3, mask, None, torch.float64)
    gq, gk, gv, gg, h0, _ = gla_inputs(p, a, v, key_padding_mask=mask, dtype=torch.float64)
    out, _ = _naive_gla(gq, gk, gv, gg, h0)
    ref = exp_linear_attention_reference(q, k * 3, v, key_padding_mask=mask)
    torch.testing.assert_close(out * mask[:, None, :, None], ref, atol=1e-12, rtol=1e-10)


def _naive_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """fla's gated delta rule, [B, T, H, .] layout, written out in fp64: decay, write at k_t the
    correction beta_t (v_t - S^T k_t), read at q_t (scale defaults to 1/sqrt(d), as fla's)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double()
    outs = []
    for t in range(T):
        S = S * g[:, t].double().exp()[..., None, None]
        u = beta[:, t].double()[..., None] * (v[:, t].double() - (S * k[:, t].double()[..., None]).sum(-2))
        S = S + k[:, t].double()[..., None] * u[..., None, :]
        outs.append(scale * (q[:, t].double()[..., None] * S).sum(-2))
    return torch.stack(outs, dim=1), (S.float() if output_final_state else None)  # out [B, T, H, D]


def _naive_head_first_release(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                              head_first=True):
    """A release whose kernel has the ``head_first`` flag, defaulting to True: the wrapper must say False."""
    assert head_first is False
    return _naive_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state)


@pytest.mark.parametrize("kernel", [_naive_gated_delta_rule, _naive_head_first_release])
def test_delta_mapping_onto_flas_kernel_reproduces_the_reference(monkeypatch, kernel):
    """The fla delta kernel's wrapper (layouts, padding made inert, the state in and out) around
    fla's recurrence written out here: equals the reference, with left padding and a state."""
    monkeypatch.setattr(fla_backend, "fla_delta_kernel", lambda: kernel)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(2, 3, 41, 8, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v, beta = torch.randn(2, 3, 41, 5, generator=gen, dtype=torch.float64), torch.rand(2, 3, 41, generator=gen)
    g = -0.5 * torch.rand(2, 3, 41, generator=gen)
    mask = padding_mask(2, 41, [0, 7])
    _, state = delta_rule_reference(q[:, :, :9], k[:, :, :9], v[:, :, :9], beta[:, :, :9], g[:, :, :9],
                                    output_final_state=True)
    for initial in (None, state):
        out, st = fla_backend.delta_rule_chunked_fla(q, k, v, beta, g, scale=0.3, key_padding_mask=mask,
                                                     initial_state=initial, output_final_state=True)
        ref, ref_st = delta_rule_reference(q, k, v, beta, g, scale=0.3, key_padding_mask=mask, initial_state=initial,
                                           output_final_state=True)
        assert out.dtype == v.dtype and st.memory.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(st.memory.double(), ref_st.memory, atol=1e-5, rtol=1e-5)
        assert (out[1, :, :7] == 0).all()


# --------------------------------------------------------------------------------------
# flex attention sliding window, eager on CPU


@pytest.mark.parametrize("num_past", [0, 5, 12])
@pytest.mark.parametrize("padded", [False, True])
def test_flex_sliding_window_matches_reference(num_past, padded):
    from retrofit.ops.backends.flex import sliding_window_attention_flex

    B, Hq, Hkv, T, d, w = 2, 4, 2, 37, 16, 8
    q = torch.randn(B, Hq, T, d, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, T + num_past, d, dtype=torch.float64) for _ in range(2))
    mask = padding_mask(B, T + num_past, [0, 7]) if padded else None
    for softcap in (None, 2.0):
        kw = dict(softcap=softcap, key_padding_mask=mask, num_past=num_past)
        out = sliding_window_attention_flex(q, k, v, w, compile=False, **kw)
        torch.testing.assert_close(out, sliding_window_attention_reference(q, k, v, w, **kw))
        # the window is exactly w wide: w - 1 or w + 1 give different outputs
        assert not torch.allclose(out, sliding_window_attention_reference(q, k, v, w - 1, **kw))
        assert not torch.allclose(out, sliding_window_attention_reference(q, k, v, w + 1, **kw))
