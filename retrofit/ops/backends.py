"""One dispatch point for the attention ops: PyTorch reference kernels or fused GPU kernels.

Backends:

* ``torch`` - the pure-PyTorch ops in :mod:`retrofit.ops` (any device, any dtype, differentiable).
* ``fla``   - causal Latte / exp-linear on flash-linear-attention's GLA Triton kernels
  (:mod:`retrofit.ops.fla_backend`); CUDA, fp16/bf16/fp32.
* ``flash`` - sliding-window attention on flash-attn 2 (:mod:`retrofit.ops.flash_backend`);
  CUDA, fp16/bf16, head dim <= 256, no key padding mask.
* ``flex``  - sliding-window attention on PyTorch flex attention (compiled); CUDA. Only on request.

``auto`` picks, per op family, the fastest backend that can run the call: ``fla`` for the
chunked Latte / exp-linear ops and ``flash`` for the sliding window when the tensors are on
CUDA in fp16/bf16 and the package imports; ``torch`` otherwise (always on CPU, and for fp32,
where fla's Triton dots would silently use TF32: request ``fla`` explicitly to accept that).
Single decoding steps stay on torch under ``auto`` (launch-bound; see ``_AUTO_CANDIDATES``).

Choosing (first that is set wins): the ``backend=`` argument of the wrappers below, then
:func:`set_default_backend` / :func:`use_backend` (what a CLI ``--backend`` flag sets), then
the ``RETROFIT_BACKEND`` environment variable, then ``auto``. A request is one name or a
comma list (``RETROFIT_BACKEND=fla,torch`` = fla for Latte, torch for the window); each op
family takes the first listed name it knows, and ``auto`` if none. A requested backend that
cannot run the call falls back to ``torch`` with a warning (once); an ``auto`` fallback is
logged at debug level. The first call of each (op, backend) pair is logged at INFO.

The wrappers have the signatures of the torch ops plus ``backend=`` and are drop-in
replacements: ``from retrofit.ops.backends import causal_latte_chunked``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from typing import Iterator

import torch

from retrofit.errors import SpecError
from retrofit.ops import exp_linear as _exp_linear
from retrofit.ops import latte as _latte
from retrofit.ops import sliding_window as _swa
from retrofit.ops.latte import LatteState
from retrofit.ops.macchiato import repeat_kv_heads

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "available_backends",
    "causal_latte_chunked",
    "causal_latte_step",
    "exp_linear_attention",
    "exp_linear_attention_step",
    "get_default_backend",
    "is_installed",
    "macchiato_attention",
    "resolve_backend",
    "set_default_backend",
    "sliding_window_attention",
    "use_backend",
]

logger = logging.getLogger(__name__)

ENV_VAR = "RETROFIT_BACKEND"
BACKENDS = ("auto", "torch", "fla", "flash", "flex")
# which backends can run which op family, fastest first (the order ``auto`` tries)
_FAMILIES: dict[str, tuple[str, ...]] = {
    "latte": ("fla", "torch"),
    "latte_step": ("fla", "torch"),
    "sliding_window": ("flash", "torch", "flex"),
}
# One decoding token is launch-bound: fused_recurrent_gla is one kernel, but mapping the gates
# onto it takes ~15 small torch kernels, more than the torch step itself. auto keeps the
# torch step; request fla (backend="fla" / RETROFIT_BACKEND=fla) to use the fused kernel.
_AUTO_CANDIDATES: dict[str, tuple[str, ...]] = {"latte": ("fla",), "latte_step": (), "sliding_window": ("flash",)}
# module that must import for each backend
_PACKAGES = {"fla": "fla.ops.gla", "flash": "flash_attn", "flex": "torch.nn.attention.flex_attention"}

_default_backend: str | None = None
_logged: set[tuple] = set()


# --------------------------------------------------------------------------------------
# choosing


def _parse(request: str | None) -> tuple[str, ...]:
    if request is None:
        return ()
    names = tuple(n.strip().lower() for n in str(request).split(",") if n.strip())
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise SpecError(
            f"unknown attention backend {', '.join(map(repr, bad))}: choose from {', '.join(BACKENDS)} "
            f"(or a comma list such as 'fla,flash'), via backend=, --backend or ${ENV_VAR}"
        )
    return names


def set_default_backend(name: str | None) -> None:
    """Process-wide request (what ``--backend`` sets); ``None`` or ``"auto"`` clears it."""
    global _default_backend
    names = _parse(name)
    _default_backend = None if not names or names == ("auto",) else ",".join(names)


def get_default_backend() -> str:
    """The request in force without a ``backend=`` argument: set_default_backend, env var, or auto."""
    return _default_backend or os.environ.get(ENV_VAR, "").strip() or "auto"


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """``with use_backend("torch"): ...`` - temporary process-wide request."""
    global _default_backend
    old = _default_backend
    set_default_backend(name)
    try:
        yield
    finally:
        _default_backend = old


@functools.lru_cache(maxsize=None)
def is_installed(backend: str) -> bool:
    """Whether the backend's package imports (cached; a broken CUDA build counts as missing)."""
    if backend == "torch":
        return True
    module = _PACKAGES.get(backend)
    if module is None:
        return False
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or an undefined-symbol error from a mismatched build
        logger.debug("retrofit.ops: backend %r unavailable (%s: %s)", backend, type(exc).__name__, exc)
        return False
    return True


def available_backends() -> dict[str, bool]:
    """``{backend: installed}`` for reporting (``retrofit bench`` writes it into results.json)."""
    return {b: is_installed(b) for b in BACKENDS if b != "auto"}


def _why_not(
    backend: str, family: str, device: torch.device, dtype: torch.dtype, features: dict, *, auto: bool = False
) -> str | None:
    """None if ``backend`` can run this call, else the reason it cannot (``auto``: stricter rules)."""
    if backend == "torch":
        return None
    if backend not in _FAMILIES[family]:
        return f"{backend} has no {family} kernel"
    if device.type != "cuda":
        return f"{backend} needs CUDA tensors (got {device.type})"
    if not is_installed(backend):
        hint = {"fla": "flash-linear-attention", "flash": "flash-attn"}.get(backend, backend)
        return f"{backend} is not installed (pip install 'retrofit[gpu]' or {hint})"
    if backend == "fla":
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"fla kernels take fp16/bf16/fp32, not {dtype}"
        if auto and dtype == torch.float32:
            # Triton dots run in TF32 by default: ask for fla explicitly to accept that in fp32
            return "fp32 stays on torch unless fla is requested (fla's fp32 dots use TF32)"
    elif backend == "flash":
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn takes fp16/bf16, not {dtype}"
        if features.get("key_padding_mask"):
            return "flash-attn path has no key padding mask (padded batches use torch)"
        if features.get("head_dim", 0) > 256 or features.get("head_dim") != features.get("value_dim"):
            return "flash-attn needs equal q/k/v head dims <= 256"
        if features.get("mixed_dtypes"):
            return "flash-attn needs q, k, v of one dtype"
    elif backend == "flex":
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"flex attention takes fp16/bf16/fp32, not {dtype}"
    return None


def resolve_backend(
    family: str,
    device: torch.device | str,
    dtype: torch.dtype,
    requested: str | None = None,
    *,
    op: str | None = None,
    **features,
) -> str:
    """The backend that runs one call of an op of ``family`` ("latte", "latte_step" or "sliding_window").

    ``requested``: None or "auto" = the default request (see module docstring).
    ``features`` describe the call (key_padding_mask, head_dim, ...) for eligibility.
    """
    if family not in _FAMILIES:
        raise ValueError(f"unknown op family {family!r}")
    device = torch.device(device)
    names = _parse(requested)
    if not names or names == ("auto",):
        names = _parse(get_default_backend())
    explicit = next((n for n in names if n in _FAMILIES[family]), None)
    op = op or family
    if explicit is not None:
        reason = _why_not(explicit, family, device, dtype, features)
        if reason is None:
            chosen = explicit
        else:
            _log_once(logging.WARNING, ("fallback", op, explicit, reason),
                      "retrofit.ops: %s requested the %s backend but %s; using torch", op, explicit, reason)
            chosen = "torch"
    else:
        chosen = "torch"
        for cand in _AUTO_CANDIDATES[family]:
            reason = _why_not(cand, family, device, dtype, features, auto=True)
            if reason is None:
                chosen = cand
                break
            _log_once(logging.DEBUG, ("auto-skip", op, cand, reason), "retrofit.ops: %s: not using %s: %s", op, cand, reason)
    _log_once(logging.INFO, ("ran", op, chosen), "retrofit.ops: %s runs on the %s backend (%s, %s)",
              op, chosen, device.type, str(dtype).replace("torch.", ""))
    return chosen


def _log_once(level: int, key: tuple, msg: str, *args) -> None:
    if key in _logged:
        return
    _logged.add(key)
    logger.log(level, msg, *args)


def _reset_log_memory() -> None:
    """Forget which choices were logged (tests)."""
    _logged.clear()


# --------------------------------------------------------------------------------------
# Latte family


def _chunk(chunk_size: int | None) -> dict:
    """``chunk_size=None`` keeps the torch op's own default."""
    return {} if chunk_size is None else {"chunk_size": chunk_size}


def causal_latte_chunked(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
    backend: str | None = "auto",
) -> tuple[torch.Tensor, LatteState | None]:
    """Dispatching :func:`retrofit.ops.latte.causal_latte_chunked` (shapes there)."""
    if resolve_backend("latte", v.device, v.dtype, backend, op="causal_latte_chunked") == "fla":
        from retrofit.ops.fla_backend import causal_latte_chunked_fla

        return causal_latte_chunked_fla(
            q_weights, k_logits, v, key_padding_mask=key_padding_mask,
            initial_state=initial_state, output_final_state=output_final_state,
        )
    return _latte.causal_latte_chunked(
        q_weights, k_logits, v, key_padding_mask=key_padding_mask,
        initial_state=initial_state, output_final_state=output_final_state, **_chunk(chunk_size),
    )


def causal_latte_step(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    state: LatteState,
    *,
    valid: torch.Tensor | None = None,
    backend: str | None = "auto",
) -> tuple[torch.Tensor, LatteState]:
    """Dispatching :func:`retrofit.ops.latte.causal_latte_step` (one decoding token)."""
    if resolve_backend("latte_step", v.device, v.dtype, backend, op="causal_latte_step") == "fla":
        from retrofit.ops.fla_backend import causal_latte_step_fla

        return causal_latte_step_fla(q_weights, k_logits, v, state, valid=valid)
    return _latte.causal_latte_step(q_weights, k_logits, v, state, valid=valid)


def exp_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
    backend: str | None = "auto",
) -> tuple[torch.Tensor, LatteState | None]:
    """Dispatching :func:`retrofit.ops.exp_linear.exp_linear_attention`."""
    if resolve_backend("latte", v.device, v.dtype, backend, op="exp_linear_attention") == "fla":
        from retrofit.ops.fla_backend import exp_linear_attention_fla

        return exp_linear_attention_fla(
            q, k, v, key_padding_mask=key_padding_mask,
            initial_state=initial_state, output_final_state=output_final_state,
        )
    return _exp_linear.exp_linear_attention(
        q, k, v, key_padding_mask=key_padding_mask,
        initial_state=initial_state, output_final_state=output_final_state, **_chunk(chunk_size),
    )


def exp_linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: LatteState,
    *,
    valid: torch.Tensor | None = None,
    backend: str | None = "auto",
) -> tuple[torch.Tensor, LatteState]:
    """Dispatching :func:`retrofit.ops.exp_linear.exp_linear_attention_step`."""
    if resolve_backend("latte_step", v.device, v.dtype, backend, op="exp_linear_attention_step") == "fla":
        from retrofit.ops.fla_backend import exp_linear_attention_step_fla

        return exp_linear_attention_step_fla(q, k, v, state, valid=valid)
    return _exp_linear.exp_linear_attention_step(q, k, v, state, valid=valid)


# --------------------------------------------------------------------------------------
# sliding window


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
    backend: str | None = "auto",
) -> torch.Tensor:
    """Dispatching :func:`retrofit.ops.sliding_window.sliding_window_attention` (window: t-w < s <= t)."""
    chosen = resolve_backend(
        "sliding_window", q.device, q.dtype, backend, op="sliding_window_attention",
        key_padding_mask=key_padding_mask is not None, head_dim=q.shape[-1], value_dim=v.shape[-1],
        mixed_dtypes=not (q.dtype == k.dtype == v.dtype),
    )
    if chosen == "flash":
        from retrofit.ops.flash_backend import sliding_window_attention_flash

        return sliding_window_attention_flash(q, k, v, window, scaling=scaling, softcap=softcap, num_past=num_past)
    if chosen == "flex":
        from retrofit.ops.flash_backend import sliding_window_attention_flex

        return sliding_window_attention_flex(
            q, k, v, window, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, num_past=num_past
        )
    return _swa.sliding_window_attention(
        q, k, v, window, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, num_past=num_past
    )


# --------------------------------------------------------------------------------------
# Macchiato = sliding window (state 0) + causal Latte (states 1..L), each on its own backend


def macchiato_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mix_logits: torch.Tensor,
    latent_logits: torch.Tensor,
    *,
    window: int,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
    backend: str | None = "auto",
) -> tuple[torch.Tensor, LatteState | None]:
    """Dispatching :func:`retrofit.ops.macchiato.macchiato_attention` (same math, same shapes)."""
    p = torch.softmax(mix_logits.float() if mix_logits.dtype in (torch.float16, torch.bfloat16) else mix_logits, dim=-1)
    swa = sliding_window_attention(
        q, k, v, window, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, backend=backend
    )
    latent, state = causal_latte_chunked(
        p[..., 1:], latent_logits, repeat_kv_heads(v, q.shape[1]), chunk_size=chunk_size,
        key_padding_mask=key_padding_mask, initial_state=initial_state, output_final_state=output_final_state,
        backend=backend,
    )
    if latent.dtype == p.dtype:  # add the window branch into the latent output in place (no T x D temporary)
        return latent.addcmul_(p[..., :1], swa), state
    return (p[..., :1] * swa + latent).to(v.dtype), state
