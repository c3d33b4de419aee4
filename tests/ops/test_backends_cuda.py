"""GPU backends against the torch reference ops, forward and backward, fp32 and bf16.

Skipped without CUDA (conftest's ``cuda`` marker), and only then. A test that names a backend
(its ``backend`` parameter) fails when that backend is missing (flash-linear-attention for
``fla``, flash-attn for ``flash``: ``pip install 'retrofit[gpu]'``; flex needs torch >= 2.5),
and requests are strict here (:func:`~retrofit.ops.backends.strict_backends`), so a named
backend that cannot run a call is an error, never a quiet fallback to the torch kernel that
would then be compared with itself.
Tolerances: bf16 inputs are compared with the torch op run in fp32 on the same bf16-rounded
inputs, by relative error of the whole tensor (||a - b|| / ||b||, ||b|| floored at an RMS of
1e-3 for gradients that vanish analytically, e.g. d/dk at T = 1); fla's fp32 path uses
Triton dots (TF32 on Ampere+), hence its looser fp32 bound.
"""
from __future__ import annotations

import logging

import pytest
import torch

import retrofit.ops as ops
import retrofit.ops.backends.fla as fla_backend
from retrofit.ops import LatteState, backends, macchiato_attention, sliding_window_attention_reference
# the torch kernels themselves (no dispatch): the references the GPU backends are compared with
from retrofit.ops.delta_rule import delta_rule_reference
from retrofit.ops.exp_linear import exp_linear_attention, exp_linear_attention_step
from retrofit.ops.latte import causal_latte_chunked, causal_latte_step
from tests.ops._inputs import padding_mask

pytestmark = pytest.mark.cuda

DEV = "cuda"
TOL = {torch.float32: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _strict_requests(monkeypatch):
    """Named backends raise instead of falling back; no process-wide request leaks in."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.set_default_backend(None)
    with backends.strict_backends():
        yield


def _require(*names: str) -> None:
    """Fail (never skip) the test when a backend it names is not installed, saying how to get it."""
    missing = [n for n in names if not backends.is_installed(n)]
    if missing:
        hints = ", ".join(f"{n}: {backends.get_backend(n).install_hint}" for n in missing)
        pytest.fail(f"backend {', '.join(missing)} not installed ({hints}): pip install 'retrofit[gpu]'", pytrace=False)


def _assert_runs_on(op: str, backend: str, dtype: torch.dtype, requested: str | None = None, **features) -> None:
    """The registry resolves ``op`` on CUDA/``dtype`` to exactly ``backend``."""
    got = backends.resolve_backend(op, DEV, dtype, requested if requested is not None else backend, **features)
    assert got == backend, f"{op} resolved to {got}, not {backend}"


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


@pytest.mark.parametrize("backend", ["fla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 63, 200, 1000])
@pytest.mark.parametrize("padded", [False, True])
def test_latte_chunked_matches_torch(backend, dtype, T, padded):
    _require(backend)
    _assert_runs_on("causal_latte_chunked", backend, dtype, key_padding_mask=padded)
    B, H, L, D = 2, 4, 16, 64
    q, k, v = _latte_inputs(B, H, T, L, D, dtype)
    mask = padding_mask(B, T, [0, min(5, T - 1)]).to(DEV) if padded else None

    def fla(q, k, v):
        return ops.causal_latte_chunked(q, k, v, key_padding_mask=mask, output_final_state=True, backend=backend)

    def ref(q, k, v):  # fp32 torch op on the same (rounded) inputs
        out, st = causal_latte_chunked(q.float(), k.float(), v.float(), key_padding_mask=mask, output_final_state=True)
        return out, st

    state_loss = lambda st: (st.m.float() * 0.1).sum()  # noqa: E731 - exercises fla's dht path
    got, want = _run(fla, (q, k, v), extra_loss=state_loss), _run(ref, (q, k, v), extra_loss=state_loss)
    _compare(got, want, dtype)
    assert _rel(got[2].m, want[2].m) < TOL[dtype]
    torch.testing.assert_close(got[2].z, want[2].z, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["fla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latte_continues_from_a_state_and_steps(backend, dtype):
    _require(backend)
    _assert_runs_on("causal_latte_step", backend, dtype)
    B, H, L, D = 2, 4, 16, 64
    q, k, v = _latte_inputs(B, H, 300, L, D, dtype)
    _, state = causal_latte_chunked(q[:, :, :200].float(), k[:, :, :200].float(), v[:, :, :200].float(), output_final_state=True)
    out, st = ops.causal_latte_chunked(
        q[:, :, 200:], k[:, :, 200:], v[:, :, 200:], initial_state=state, output_final_state=True, backend=backend
    )
    ref, ref_st = causal_latte_chunked(
        q[:, :, 200:].float(), k[:, :, 200:].float(), v[:, :, 200:].float(), initial_state=state, output_final_state=True
    )
    assert _rel(out, ref) < TOL[dtype] and _rel(st.m, ref_st.m) < TOL[dtype]

    valid = torch.tensor([True, False], device=DEV)
    o1, s1 = ops.causal_latte_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state, valid=valid, backend=backend)
    o2, s2 = causal_latte_step(q[:, :, 0].float(), k[:, :, 0].float(), v[:, :, 0].float(), state, valid=valid)
    assert _rel(o1[0], o2[0]) < TOL[dtype] and (o1[1] == 0).all()
    assert _rel(s1.m, s2.m) < TOL[dtype]
    torch.testing.assert_close(s1.m[1], state.m[1])  # the padded row keeps its state
    torch.testing.assert_close(s1.z, s2.z)


@pytest.mark.parametrize("backend", ["fla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exp_linear_matches_torch(backend, dtype):
    _require(backend)
    _assert_runs_on("exp_linear_attention", backend, dtype)
    _assert_runs_on("exp_linear_attention_step", backend, dtype)
    B, H, T, d = 2, 4, 257, 64
    q, k, v = (torch.randn(B, H, T, d, device=DEV).to(dtype) for _ in range(3))
    fla = lambda q, k, v: ops.exp_linear_attention(q, k, v, output_final_state=True, backend=backend)  # noqa: E731
    ref = lambda q, k, v: exp_linear_attention(q.float(), k.float(), v.float(), output_final_state=True)  # noqa: E731
    got, want = _run(fla, (q, k, v)), _run(ref, (q, k, v))
    _compare(got, want, dtype)
    o1, _ = ops.exp_linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], got[2], backend=backend)
    o2, _ = exp_linear_attention_step(q[:, :, 0].float(), k[:, :, 0].float(), v[:, :, 0].float(), want[2])
    assert _rel(o1, o2) < TOL[dtype]


def _delta_inputs(B, H, T, d, D, dtype, *, decay=0.1):
    """Unit-norm q, k (as the layer gives them), values, write strengths in (0, 1), log decays in [-decay, 0]."""
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, T, d, device=DEV), dim=-1).to(dtype) for _ in range(2))
    v = torch.randn(B, H, T, D, device=DEV).to(dtype)
    beta = torch.rand(B, H, T, device=DEV)
    g = -decay * torch.rand(B, H, T, device=DEV)
    return q, k, v, beta, g


def _run_delta_backward(on_backend, ref, inputs, **kw):
    """Forward + backward of both; skips (after the caller checked the forward) where fla itself
    refuses the gated delta rule's backward: fla >= 0.6 on Hopper with Triton 3.4-3.7.0, whose
    miscompile of that kernel fla guards against (fla-org/flash-linear-attention#640; Triton
    >= 3.7.1 or tilelang lifts it)."""
    refused = fla_backend.delta_backward_refused()
    if refused:
        pytest.skip(refused)
    return _run(on_backend, inputs, **kw), _run(ref, inputs, **kw)


def _delta_pair(backend, mask, initial_state=None):
    """(the op on ``backend``, the token-by-token reference in fp32 on the same rounded inputs)."""
    def on_backend(q, k, v, beta, g):
        return ops.delta_rule_chunked(q, k, v, beta, g, scale=0.125, key_padding_mask=mask, initial_state=initial_state,
                                      output_final_state=True, backend=backend)

    def ref(q, k, v, beta, g):
        return delta_rule_reference(q.float(), k.float(), v.float(), beta, g, scale=0.125, key_padding_mask=mask,
                                    initial_state=initial_state, output_final_state=True)

    return on_backend, ref


@pytest.mark.parametrize("backend", ["fla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 63, 200, 1000])
@pytest.mark.parametrize("padded", [False, True])
def test_delta_rule_chunked_matches_reference(backend, dtype, T, padded):
    _require(backend)
    _assert_runs_on("delta_rule_chunked", backend, dtype, key_padding_mask=padded)
    inputs = _delta_inputs(2, 3, T, 64, 64, dtype)
    mask = padding_mask(2, T, [0, min(5, T - 1)]).to(DEV) if padded else None
    on_backend, ref = _delta_pair(backend, mask)
    with torch.no_grad():
        (out, state), (want_out, want_state) = on_backend(*inputs), ref(*inputs)
    assert _rel(out, want_out) < TOL[dtype] and _rel(state.memory, want_state.memory) < TOL[dtype]
    if padded:
        assert (out[1, :, :min(5, T - 1)] == 0).all()
    state_loss = lambda st: (st.memory.float() * 0.1).sum()  # noqa: E731 - exercises the final state's gradient
    got, want = _run_delta_backward(on_backend, ref, inputs, extra_loss=state_loss)
    _compare(got, want, dtype)  # out, and the gradients of q, k, v, beta and g


@pytest.mark.parametrize("backend", ["fla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_continues_from_a_state(backend, dtype):
    """A prefill split in two through the state equals the whole, and the final memory is the reference's."""
    _require(backend)
    q, k, v, beta, g = _delta_inputs(2, 3, 300, 64, 32, dtype)
    _, state = delta_rule_reference(q[:, :, :200].float(), k[:, :, :200].float(), v[:, :, :200].float(), beta[:, :, :200],
                                    g[:, :, :200], output_final_state=True)
    tail = [x[:, :, 200:] for x in (q, k, v, beta, g)]
    on_backend, ref = _delta_pair(backend, None, initial_state=state)
    with torch.no_grad():
        (out, st), (want_out, want_st) = on_backend(*tail), ref(*tail)
    assert _rel(out, want_out) < TOL[dtype] and _rel(st.memory, want_st.memory) < TOL[dtype]
    _compare(*_run_delta_backward(on_backend, ref, tail), dtype)


@pytest.mark.parametrize("backend", ["fla"])
def test_delta_rule_survives_strong_decay_and_full_writes(backend):
    """log decays down to -20 a token and beta near 1 (the memory wiped and rewritten): finite, as the reference."""
    _require(backend)
    q, k, v, beta, g = _delta_inputs(1, 2, 257, 64, 64, torch.bfloat16, decay=20.0)
    beta = 1.0 - 1e-3 * torch.rand_like(beta)
    on_backend, ref = _delta_pair(backend, None)
    with torch.no_grad():
        (out, _), (want_out, _) = on_backend(q, k, v, beta, g), ref(q, k, v, beta, g)
    assert torch.isfinite(out).all() and _rel(out, want_out) < TOL[torch.bfloat16]
    _compare(*_run_delta_backward(on_backend, ref, (q, k, v, beta, g)), torch.bfloat16)


def test_delta_rule_auto_stays_on_torch():
    """The fla delta kernel is on request only: auto keeps the torch form, in bf16 too."""
    _assert_runs_on("delta_rule_chunked", "torch", torch.bfloat16, "auto")


@pytest.mark.parametrize("backend", ["fla"])
def test_latte_survives_large_logit_spread(backend):
    _require(backend)
    q, k, v = _latte_inputs(1, 2, 512, 16, 64, torch.bfloat16)
    k = (k.float() * 30).to(torch.bfloat16)  # spreads of hundreds inside a chunk
    out, _ = ops.causal_latte_chunked(q, k, v, backend=backend)
    ref, _ = causal_latte_chunked(q.float(), k.float(), v.float())
    assert torch.isfinite(out).all() and _rel(out, ref) < TOL[torch.bfloat16]


# --------------------------------------------------------------------------------------
# flash-attn and flex


def _swa_inputs(B, Hq, Hkv, T, d, dtype, num_past=0):
    q = torch.randn(B, Hq, T, d, device=DEV).to(dtype)
    k = torch.randn(B, Hkv, T + num_past, d, device=DEV).to(dtype)
    v = torch.randn(B, Hkv, T + num_past, d, device=DEV).to(dtype)
    return q, k, v


@pytest.mark.parametrize("backend", ["flash"])
@pytest.mark.parametrize("T,window", [(100, 16), (1000, 128), (777, 128)])
@pytest.mark.parametrize("softcap", [None, 50.0])
@pytest.mark.parametrize("gqa", [1, 4])
def test_sliding_window_matches_reference(backend, T, window, softcap, gqa):
    _require(backend)
    dtype = torch.bfloat16
    _assert_runs_on("sliding_window_attention", backend, dtype, head_dim=128, value_dim=128)
    q, k, v = _swa_inputs(2, 8, 8 // gqa, T, 128, dtype)
    kw = dict(softcap=softcap, scaling=0.07)
    flash = lambda q, k, v: (ops.sliding_window_attention(q, k, v, window, backend=backend, **kw), None)  # noqa: E731
    ref = lambda q, k, v: (sliding_window_attention_reference(q.float(), k.float(), v.float(), window, **kw), None)  # noqa: E731
    _compare(_run(flash, (q, k, v)), _run(ref, (q, k, v)), dtype)


@pytest.mark.parametrize("backend", ["flash", "flex"])
@pytest.mark.parametrize("num_past", [1, 50, 300])
def test_sliding_window_with_cached_keys(backend, num_past):
    _require(backend)
    _assert_runs_on("sliding_window_attention", backend, torch.bfloat16, head_dim=64, value_dim=64)
    q, k, v = _swa_inputs(2, 8, 2, 7, 64, torch.bfloat16, num_past=num_past)
    out = ops.sliding_window_attention(q, k, v, 128, num_past=num_past, backend=backend)
    ref = sliding_window_attention_reference(q.float(), k.float(), v.float(), 128, num_past=num_past)
    assert _rel(out, ref) < TOL[torch.bfloat16]
    off = sliding_window_attention_reference(q.float(), k.float(), v.float(), 127, num_past=num_past)
    if num_past >= 127:  # the off-by-one matters only once the window is full
        assert _rel(out, off) > 2 * TOL[torch.bfloat16]


@pytest.mark.parametrize("backend", ["flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_padded_sliding_window_matches_reference(backend, dtype, padded):
    _require(backend)
    _assert_runs_on("sliding_window_attention", backend, dtype, key_padding_mask=padded, head_dim=64, value_dim=64)
    q, k, v = _swa_inputs(2, 8, 2, 600, 64, dtype)
    mask = padding_mask(2, 600, [0, 33]).to(DEV) if padded else None
    kw = dict(softcap=30.0, key_padding_mask=mask)
    flex = lambda q, k, v: (ops.sliding_window_attention(q, k, v, 128, backend=backend, **kw), None)  # noqa: E731
    ref = lambda q, k, v: (sliding_window_attention_reference(q.float(), k.float(), v.float(), 128, **kw), None)  # noqa: E731
    _compare(_run(flex, (q, k, v)), _run(ref, (q, k, v)), dtype)


# --------------------------------------------------------------------------------------
# the full Macchiato op and auto dispatch


def _macchiato_inputs(dtype):
    B, Hq, Hkv, T, d, L = 2, 8, 2, 700, 128, 16
    q, k, v = _swa_inputs(B, Hq, Hkv, T, d, dtype)
    mix = torch.randn(B, Hq, T, L + 1, device=DEV).to(dtype)
    lat = (torch.randn(B, Hq, T, L, device=DEV) * 3).to(dtype)
    return q, k, v, mix, lat


def _macchiato_matches_torch(dtype, requested):
    run = lambda *x: macchiato_attention(*x, window=128, softcap=50.0, backend=requested)  # noqa: E731
    ref = lambda *x: macchiato_attention(*(t.float() for t in x), window=128, softcap=50.0, backend="torch")  # noqa: E731
    inputs = _macchiato_inputs(dtype)
    _compare(_run(run, inputs), _run(ref, inputs), dtype)


@pytest.mark.parametrize("latte,window,dtype", [
    ("fla", "flash", torch.bfloat16), ("fla", "flex", torch.bfloat16), ("fla", "flex", torch.float32),
])
def test_macchiato_on_named_backends_matches_torch(latte, window, dtype):
    _require(latte, window)
    requested = f"{latte},{window}"
    _assert_runs_on("causal_latte_chunked", latte, dtype, requested)
    _assert_runs_on("sliding_window_attention", window, dtype, requested, head_dim=128, value_dim=128)
    _macchiato_matches_torch(dtype, requested)


def test_macchiato_auto_takes_the_gpu_backends_in_bf16(caplog):
    """auto on CUDA: fla and flash in bf16 (the ``gpu`` extra), torch in fp32 (TF32 stays off)."""
    _require("fla", "flash")
    _assert_runs_on("causal_latte_chunked", "fla", torch.bfloat16, "auto")
    _assert_runs_on("sliding_window_attention", "flash", torch.bfloat16, "auto", head_dim=128, value_dim=128)
    _assert_runs_on("causal_latte_chunked", "torch", torch.float32, "auto")
    caplog.set_level(logging.INFO, logger="retrofit.ops.backends")
    backends._reset_log_memory()
    _macchiato_matches_torch(torch.bfloat16, None)
    ran = " ".join(r.getMessage() for r in caplog.records)
    assert "causal_latte_chunked runs on the fla backend" in ran
    assert "sliding_window_attention runs on the flash backend" in ran


@pytest.mark.parametrize("backend", ["torch", "fla"])
def test_empty_state_roundtrip_on_cuda(backend):
    _require(backend)
    st = LatteState.empty(1, 2, 3, 4, device=DEV)
    q, k, v = _latte_inputs(1, 2, 5, 3, 4, torch.bfloat16)
    out, _ = ops.causal_latte_chunked(q, k, v, initial_state=st, backend=backend)
    ref, _ = causal_latte_chunked(q.float(), k.float(), v.float())
    assert _rel(out, ref) < TOL[torch.bfloat16]
