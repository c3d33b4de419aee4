"""The ``fla`` backend: causal Latte and exp-linear attention on flash-linear-attention's GLA
Triton kernels, and the gated delta rule on its own (CUDA; fp16/bf16, and fp32 on request:
Triton's fp32 dots use TF32).

Causal Latte is a gated linear recurrence (design.md section 3). With the running
log-normaliser ``z_t = logcumsumexp_{s<=t} a_s`` per latent,

    m_t = f_t * m_{t-1} + (1 - f_t) v_t^T,   f_t = exp(z_{t-1} - z_t),  1 - f_t = exp(a_t - z_t)
    o_t = q_t^T m_t

which is Gated Linear Attention ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale * q_t^T S_t``
with ``q = p(.|t)`` (the mixing weights), ``k = 1 - f_t``, ``g = log f_t``, ``scale = 1``.
GLA's state ``S_t`` *is* our normalised state ``m_t`` (the recurrence is already
normalised), so ``initial_state`` / ``final_state`` map one to one onto ``LatteState.m``;
``LatteState.z`` is the running log-normaliser, computed here in torch (O(T L)).

Gate details: ``g_1 = z_init - z_1`` (``z_init = -inf`` for an empty state; any finite g
works there because the state is zero, and we use 0). Padded tokens (``a = -inf``) get
``k = 0, g = 0``: they leave the state untouched, and their outputs are zeroed.
Every ``g`` is finite and <= 0, so all exponents in fla's chunk kernels stay <= 0.

The gated delta rule (:mod:`retrofit.ops.delta_rule`) is fla's own recurrence, with the same
conventions (decay, then read at ``k_t`` and write ``beta_t (v_t - S^T k_t)``, then read at ``q_t``;
state ``(d, D)``), so it maps one to one onto ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
with the layouts transposed; padded tokens get ``beta = g = 0`` and zero q, k, v, as in the torch
form. It is on request only (``backend="fla"`` or ``RETROFIT_BACKEND=fla``) until its backward
has been checked and timed on a GPU; where fla refuses that backward (:func:`delta_backward_refused`)
a call autograd will differentiate falls back to torch with a warning (an error under strict
requests), and calls without a backward (evaluation, prefill) still run on fla.

exp-linear attention is causal Latte with ``L = d`` latents, ``a = k`` and time-dependent
mixing weights ``softmax_i(q_{t,i} + z_{t,i})`` (see ``retrofit/ops/exp_linear.py``), so it
runs on the same kernels after computing those weights in torch.

Layouts: our tensors are ``(B, H, T, .)``; fla takes ``[B, T, H, .]`` (older releases had a
``head_first`` flag, passed as ``False`` when the installed version has it). Kernels:
``fla.ops.gla.chunk_gla`` (training / prefill) and ``fla.ops.gla.fused_recurrent_gla``
(decoding). Nothing here checks the device: the registry (:mod:`retrofit.ops.backends.registry`)
calls these kernels only for calls this backend's declaration accepts. A single decoding token
is launch-bound (mapping the gates takes ~15 small torch kernels around the one fused kernel,
more than the torch step itself), so ``auto`` keeps the steps on torch; request fla to use them.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
from typing import Callable

import torch

from retrofit.ops.backends.registry import Backend, Call, Kernel, register_backend
from retrofit.ops.delta_rule import DeltaState, masked_inputs
from retrofit.ops._common import compute_dtype
from retrofit.ops.exp_linear import exp_linear_weights
from retrofit.ops.latte import NEG_INF, LatteState, finite_or_zero, masked_logits

__all__ = [
    "gla_inputs",
    "causal_latte_chunked_fla",
    "causal_latte_step_fla",
    "exp_linear_attention_fla",
    "exp_linear_attention_step_fla",
    "delta_rule_chunked_fla",
    "fla_kernels",
    "fla_delta_kernel",
    "delta_backward_refused",
    "quick_autotune",
    "quick_configs",
    "BACKEND",
]

# kernels' input dtypes: half types stay, everything else runs in fp32
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


AUTOTUNE_ENV = "RETROFIT_FLA_AUTOTUNE"


@functools.lru_cache(maxsize=None)
def fla_kernels() -> tuple[Callable, Callable]:
    """``(chunk_gla, fused_recurrent_gla)``; raises ImportError when fla is not installed.

    ``RETROFIT_FLA_AUTOTUNE=quick`` narrows the autotuning of fla's kernels (see
    :func:`quick_autotune`) before their first call.
    """
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    _apply_autotune_mode()
    return chunk_gla, fused_recurrent_gla


@functools.lru_cache(maxsize=None)
def fla_delta_kernel() -> Callable:
    """fla's ``chunk_gated_delta_rule``; raises ImportError when fla lacks it (fla < 0.1.2)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise ImportError("the fla backend's delta rule needs flash-linear-attention with "
                          "fla.ops.gated_delta_rule (pip install -U flash-linear-attention)") from exc
    _apply_autotune_mode()
    return chunk_gated_delta_rule


def _apply_autotune_mode() -> None:
    mode = os.environ.get(AUTOTUNE_ENV, "full").strip().lower()
    if mode == "quick":
        modules = [m for name, m in list(sys.modules.items()) if name.startswith("fla.ops.") and m is not None]
        quick_autotune(modules)
    elif mode != "full":
        raise ValueError(f"{AUTOTUNE_ENV}={mode!r}: use 'full' (fla's autotuning) or 'quick'")


def quick_configs(configs: list) -> list:
    """The autotuning candidates ``quick`` keeps: the fewest pipeline stages and the warp count
    nearest 4 among them, every block size (which decides what fits in shared memory)."""
    if len(configs) <= 1:
        return list(configs)
    stages = min(c.num_stages for c in configs)
    kept = [c for c in configs if c.num_stages == stages]
    warps = min({c.num_warps for c in kept}, key=lambda w: (abs(w - 4), w))
    return [c for c in kept if c.num_warps == warps]


def quick_autotune(modules) -> int:
    """Narrow every Triton autotuner found in ``modules`` to :func:`quick_configs`; returns how
    many were narrowed.

    fla autotunes each kernel over up to ~100 configurations on its first call per key (head
    dims, dtype). Compiling them is minutes per key on a fresh machine (measured on an H100:
    92 s for Latte's first forward at L_h 16, d 64, 79 s for its first backward, ``BENCHMARKS.md``),
    which a short job or a test run cannot afford. ``quick`` keeps a handful per kernel.
    """
    narrowed, seen = 0, set()
    for module in modules:
        for obj in list(vars(module).values()):
            while obj is not None and id(obj) not in seen:  # Heuristics -> Autotuner -> JITFunction
                seen.add(id(obj))
                configs = getattr(obj, "configs", None)
                if isinstance(configs, list) and configs and hasattr(configs[0], "num_warps") and hasattr(obj, "keys"):
                    obj.configs = quick_configs(configs)
                    narrowed += 1
                obj = getattr(obj, "fn", None)
    return narrowed


@functools.lru_cache(maxsize=None)
def _takes_head_first(fn: Callable) -> bool:
    try:
        return "head_first" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _kernel_dtype(v: torch.Tensor) -> torch.dtype:
    return v.dtype if v.dtype in _KERNEL_DTYPES else torch.float32


def gla_inputs(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Map causal Latte inputs ``(B, H, T, L)``, ``(B, H, T, L)``, ``(B, H, T, D)`` onto GLA.

    Returns ``(q, k, v, g, h0, z_last)``: ``q, k, g`` ``[B, T, H, L]`` and ``v`` ``[B, T, H, D]``
    in ``dtype`` (default: ``v``'s dtype for fp16/bf16/fp32, else fp32), ``h0`` the fp32
    initial state ``[B, H, L, D]`` or None, and ``z_last`` ``(B, H, L)`` fp32, the
    log-normaliser after the last token (the ``z`` of the final :class:`LatteState`).
    The gates are computed in at least fp32 and cast last.
    """
    dtype = dtype or _kernel_dtype(v)
    gate_dtype = torch.promote_types(torch.float32, k_logits.dtype)
    a = masked_logits(k_logits, key_padding_mask, gate_dtype)
    z = torch.logcumsumexp(a, dim=2)  # (B,H,T,L)
    if initial_state is not None:
        z_init = initial_state.z.to(gate_dtype).unsqueeze(2)
        z = torch.logaddexp(z_init, z)
    else:
        z_init = torch.full_like(a[:, :, :1], NEG_INF)
    z_prev = torch.cat([z_init, z[:, :, :-1]], dim=2)
    # f_t = exp(z_{t-1} - z_t); where z_{t-1} = -inf the state is empty and any finite g will do
    g = torch.where(z_prev == NEG_INF, torch.zeros_like(z), z_prev - finite_or_zero(z))
    k = torch.exp(a - finite_or_zero(z))  # 1 - f_t; 0 for padded tokens and before any token

    def btH(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).to(dtype).contiguous()

    h0 = None if initial_state is None else initial_state.m.float().contiguous()
    return btH(q_weights), btH(k), btH(v), btH(g), h0, z[:, :, -1]


def _call(fn: Callable, q, k, v, g, h0, *, gate_kw: str, output_final_state: bool):
    kwargs = {gate_kw: g, "scale": 1.0, "initial_state": h0, "output_final_state": output_final_state}
    if _takes_head_first(fn):
        kwargs["head_first"] = False
    return fn(q, k, v, **kwargs)


def _finish(
    o: torch.Tensor,
    ht: torch.Tensor | None,
    z_last: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, LatteState | None]:
    out = o.transpose(1, 2)
    if key_padding_mask is not None:
        out = out * key_padding_mask.bool()[:, None, :, None].to(out.dtype)
    state = LatteState(m=ht.float(), z=z_last) if output_final_state else None
    return out.to(v.dtype), state


def _run_gla(
    kernel: Callable,
    gate_kw: str,
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    initial_state: LatteState | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, LatteState | None]:
    """Causal Latte (``q_weights``, ``k_logits`` ``(B, H, T, L)``, ``v`` ``(B, H, T, D)``) through one
    fla GLA ``kernel`` whose gate keyword is ``gate_kw``: :func:`gla_inputs` in, ``(out (B, H, T, D)
    in v.dtype, LatteState or None)`` out."""
    q, k, vv, g, h0, z_last = gla_inputs(
        q_weights, k_logits, v, key_padding_mask=key_padding_mask, initial_state=initial_state
    )
    o, ht = _call(kernel, q, k, vv, g, h0, gate_kw=gate_kw, output_final_state=output_final_state)
    return _finish(o, ht, z_last, v, key_padding_mask, output_final_state)


def causal_latte_chunked_fla(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int = 64,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LatteState | None]:
    """``causal_latte_chunked`` through ``chunk_gla``; same shapes and returns.

    ``chunk_size`` is accepted for signature compatibility; fla picks its own (64).
    The final state's ``m`` is fp32 (fla keeps states in fp32).
    """
    del chunk_size
    T = v.shape[2]
    if T == 0:
        from retrofit.ops.latte import causal_latte_chunked

        return causal_latte_chunked(
            q_weights, k_logits, v, key_padding_mask=key_padding_mask,
            initial_state=initial_state, output_final_state=output_final_state,
        )
    chunk_gla, _ = fla_kernels()
    return _run_gla(chunk_gla, "g", q_weights, k_logits, v, key_padding_mask, initial_state, output_final_state)


def causal_latte_recurrent_fla(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = True,
) -> tuple[torch.Tensor, LatteState | None]:
    """Token-serial form through ``fused_recurrent_gla`` (few tokens: decoding, short prefill)."""
    _, fused_recurrent_gla = fla_kernels()
    return _run_gla(fused_recurrent_gla, "gk", q_weights, k_logits, v, key_padding_mask, initial_state,
                    output_final_state)


def causal_latte_step_fla(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    state: LatteState,
    *,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LatteState]:
    """``causal_latte_step`` (one token: ``(B, H, L)``, ``(B, H, L)``, ``(B, H, D)``) on ``fused_recurrent_gla``."""
    mask = None if valid is None else valid.bool()[:, None]
    out, new_state = causal_latte_recurrent_fla(
        q_weights.unsqueeze(2), k_logits.unsqueeze(2), v.unsqueeze(2),
        key_padding_mask=mask, initial_state=state, output_final_state=True,
    )
    return out.squeeze(2), new_state


def exp_linear_attention_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int = 32,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LatteState | None]:
    """``exp_linear_attention`` (q, k ``(B, H, T, d)``, v ``(B, H, T, D)``) through ``chunk_gla``."""
    p, a = exp_linear_weights(q, k, key_padding_mask, initial_state, compute_dtype(q, k))
    return causal_latte_chunked_fla(
        p, a, v, chunk_size=chunk_size, key_padding_mask=key_padding_mask,
        initial_state=initial_state, output_final_state=output_final_state,
    )


def exp_linear_attention_step_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: LatteState,
    *,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LatteState]:
    """``exp_linear_attention_step`` (q, k ``(B, H, d)``, v ``(B, H, D)``) through ``fused_recurrent_gla``."""
    mask = None if valid is None else valid.bool()[:, None]
    p, a = exp_linear_weights(q.unsqueeze(2), k.unsqueeze(2), mask, state, compute_dtype(q, k))
    out, new_state = causal_latte_recurrent_fla(
        p, a, v.unsqueeze(2), key_padding_mask=mask, initial_state=state, output_final_state=True,
    )
    return out.squeeze(2), new_state


def delta_rule_chunked_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: DeltaState | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, DeltaState | None]:
    """``delta_rule_chunked`` (q, k ``(B, H, T, d)``, v ``(B, H, T, D)``, beta, g ``(B, H, T)``)
    through fla's ``chunk_gated_delta_rule``; same returns, the final memory in fp32.

    ``chunk_size`` is accepted for signature compatibility; fla picks its own (64). The kernel's
    inputs are in ``v``'s dtype (fp16/bf16/fp32, else fp32); ``g`` and ``beta`` in fp32.
    """
    del chunk_size
    if q.shape[2] == 0:
        from retrofit.ops.delta_rule import delta_rule_chunked

        return delta_rule_chunked(q, k, v, beta, g, scale=scale, key_padding_mask=key_padding_mask,
                                  initial_state=initial_state, output_final_state=output_final_state)
    kernel = fla_delta_kernel()
    out_dtype = v.dtype
    q, k, v, beta, g = masked_inputs(q, k, v, beta, g, key_padding_mask, qkv_dtype=_kernel_dtype(v))

    def btH(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).contiguous()

    h0 = None if initial_state is None else initial_state.memory.float().contiguous()
    kwargs = {"scale": scale, "initial_state": h0, "output_final_state": output_final_state}
    if _takes_head_first(kernel):  # releases with the flag (some defaulted it to True)
        kwargs["head_first"] = False
    o, ht = kernel(btH(q), btH(k), btH(v), btH(g.float()), btH(beta.float()), **kwargs)
    out = o.transpose(1, 2)
    if key_padding_mask is not None:
        out = out.masked_fill(~key_padding_mask.bool()[:, None, :, None].to(out.device), 0.0)
    return out.to(out_dtype), (DeltaState(ht.float()) if output_final_state else None)


@functools.lru_cache(maxsize=None)
def delta_backward_refused() -> str | None:
    """Why fla will refuse the gated delta rule's backward on this machine, or None.

    fla (0.6) raises in that backward on Hopper GPUs with Triton 3.4.0-3.7.0, which miscompiles
    its gated ``chunk_bwd_dqkwg`` (fla-org/flash-linear-attention#640), unless tilelang is
    installed to run it instead.
    Read from fla's own flags, so a release that drops the guard (or moves the bound) is followed.
    """
    try:
        from fla.utils import env, hardware
    except ImportError:
        return None
    hopper = getattr(hardware, "IS_NVIDIA_HOPPER", False)
    broken_triton = getattr(env, "TRITON_ABOVE_3_4_0", False) and not getattr(env, "TRITON_ABOVE_3_7_1", True)
    if hopper and broken_triton and importlib.util.find_spec("tilelang") is None:
        import triton

        return (f"fla refuses the gated delta rule's backward on Hopper GPUs with Triton {triton.__version__} "
                "(a miscompile; Triton >= 3.7.1 or `pip install tilelang` lifts it)")
    return None


def _check(op: str, call: Call) -> str | None:
    if op == "delta_rule_chunked" and call.needs_grad:
        return delta_backward_refused()
    return None


_HALF = frozenset({torch.float16, torch.bfloat16})

BACKEND = register_backend(
    Backend(
        name="fla",
        priority=20,
        kernels={
            "causal_latte_chunked": causal_latte_chunked_fla,
            "causal_latte_step": Kernel(causal_latte_step_fla, auto=False),
            "exp_linear_attention": exp_linear_attention_fla,
            "exp_linear_attention_step": Kernel(exp_linear_attention_step_fla, auto=False),
            "delta_rule_chunked": Kernel(delta_rule_chunked_fla, auto=False),
        },
        package="fla.ops.gla",
        install_hint="flash-linear-attention",
        devices=frozenset({"cuda"}),
        dtypes=_HALF | {torch.float32},
        auto_dtypes=_HALF,
        auto_dtype_note="fla's fp32 Triton dots use TF32",
        check=_check,
    )
)
