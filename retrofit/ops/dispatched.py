"""The dispatched ops: one public callable per op, re-exported as ``retrofit.ops.<op>``.

Each takes the arguments of its torch kernel (shapes in that kernel's module: :mod:`.latte`,
:mod:`.exp_linear`, :mod:`.sliding_window`, :mod:`.lavo`, :mod:`.llp`) plus ``backend=``, and
runs the kernel of the backend the registry picks (:mod:`retrofit.ops.backends.registry`).
A backend's own kernel, without dispatch: ``op.kernel("torch")``.
"""
from __future__ import annotations

from typing import Any

from retrofit.ops import exp_linear, latte, lavo, llp, sliding_window
from retrofit.ops.backends import Call
from retrofit.ops.backends.registry import Op

__all__ = [
    "bidirectional_latte",
    "causal_latte",
    "causal_latte_chunked",
    "causal_latte_recurrent",
    "causal_latte_step",
    "exp_linear_attention",
    "exp_linear_attention_step",
    "lavo_attention",
    "llp_attention",
    "llp_attention_cached",
    "local_attention",
    "orthogonal_memory_attention",
    "orthogonal_memory_recurrent",
    "orthogonal_memory_step",
    "sliding_window_attention",
    "sliding_window_lse",
]


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs[name]


def _on_values(*args: Any, **kwargs: Any) -> Call:
    """Latte-type ops (q, k, v, ...) run in the values' dtype (their gates are >= fp32 either way)."""
    v = _arg(args, kwargs, 2, "v")
    return Call(v.device, v.dtype, key_padding_mask=kwargs.get("key_padding_mask") is not None)


def _on_queries(*args: Any, **kwargs: Any) -> Call:
    q = _arg(args, kwargs, 0, "q")
    return Call(q.device, q.dtype, key_padding_mask=kwargs.get("key_padding_mask") is not None)


def _window_call(*args: Any, **kwargs: Any) -> Call:
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate("qkv"))
    return Call(
        q.device, q.dtype, key_padding_mask=kwargs.get("key_padding_mask") is not None, head_dim=q.shape[-1],
        value_dim=v.shape[-1], mixed_dtypes=not (q.dtype == k.dtype == v.dtype),
    )


causal_latte = Op("causal_latte", latte.causal_latte, _on_values)
causal_latte_chunked = Op("causal_latte_chunked", latte.causal_latte_chunked, _on_values)
causal_latte_recurrent = Op("causal_latte_recurrent", latte.causal_latte_recurrent, _on_values)
causal_latte_step = Op("causal_latte_step", latte.causal_latte_step, _on_values)
bidirectional_latte = Op("bidirectional_latte", latte.bidirectional_latte, _on_values)
exp_linear_attention = Op("exp_linear_attention", exp_linear.exp_linear_attention, _on_values)
exp_linear_attention_step = Op("exp_linear_attention_step", exp_linear.exp_linear_attention_step, _on_values)
sliding_window_attention = Op("sliding_window_attention", sliding_window.sliding_window_attention, _window_call)
sliding_window_lse = Op("sliding_window_lse", sliding_window.sliding_window_lse, _on_queries)
lavo_attention = Op("lavo_attention", lavo.lavo_attention, _on_values)
local_attention = Op("local_attention", lavo.local_attention, _on_values)
orthogonal_memory_attention = Op("orthogonal_memory_attention", lavo.orthogonal_memory_attention, _on_queries)
orthogonal_memory_recurrent = Op("orthogonal_memory_recurrent", lavo.orthogonal_memory_recurrent, _on_queries)
orthogonal_memory_step = Op("orthogonal_memory_step", lavo.orthogonal_memory_step, _on_queries)
llp_attention = Op("llp_attention", llp.llp_attention, _on_values)
llp_attention_cached = Op("llp_attention_cached", llp.llp_attention_cached, _on_values)
