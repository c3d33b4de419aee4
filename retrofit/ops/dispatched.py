"""The dispatched ops, each declared once here: one public callable per op.

An op is declared by its torch kernel (which names it and gives its signature and docstring;
shapes in that kernel's module: :mod:`.latte`, :mod:`.exp_linear`, :mod:`.sliding_window`,
:mod:`.slots`, :mod:`.lavo`, :mod:`.llp`, :mod:`.delta_rule`, :mod:`.hedgehog`, :mod:`.exact_tier`) and a
function describing a call for the registry. Everything else
derives from these lines: :data:`OPS` and ``__all__`` below, the exports of :mod:`retrofit.ops`,
and the ``torch`` backend's kernels (:mod:`retrofit.ops.backends.pytorch`).

Each op takes the arguments of its torch kernel plus ``backend=``, and runs the kernel of the
backend the registry picks (:mod:`retrofit.ops.backends.registry`). A backend's own kernel,
without dispatch: ``op.kernel("torch")``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from retrofit.ops import delta_rule, exact_tier, exp_linear, hedgehog, latte, lavo, llp, sliding_window, slots
from retrofit.ops.backends.registry import Call, Op


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs[name]


def _on_values(*args: Any, **kwargs: Any) -> Call:
    """Latte-type ops (q, k, v, ...) run in the values' dtype (their gates are >= fp32 either way)."""
    v = _arg(args, kwargs, 2, "v")
    return Call(v.device, v.dtype, key_padding_mask=kwargs.get("key_padding_mask") is not None)


def _on_values_and_grad(*args: Any, **kwargs: Any) -> Call:
    """As :func:`_on_values`, and whether autograd will differentiate the call (a kernel may have a
    forward everywhere and a backward only on some machines)."""
    call = _on_values(*args, **kwargs)
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    return dataclasses.replace(call, needs_grad=torch.is_grad_enabled() and any(x.requires_grad for x in tensors))


def _on_queries(*args: Any, **kwargs: Any) -> Call:
    q = _arg(args, kwargs, 0, "q")
    return Call(q.device, q.dtype, key_padding_mask=kwargs.get("key_padding_mask") is not None)


def _on_features_and_grad(*args: Any, **kwargs: Any) -> Call:
    """Hedgehog reads ``(fq, fk, v, ...)`` run in the features' dtype (fp32 at least), and are trained
    (``retrofit fit``): whether autograd will differentiate the call, as :func:`_on_values_and_grad`."""
    fq = _arg(args, kwargs, 0, "fq")
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    return Call(fq.device, fq.dtype, needs_grad=torch.is_grad_enabled() and any(x.requires_grad for x in tensors))


def _window_call(*args: Any, **kwargs: Any) -> Call:
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate("qkv"))
    return Call(
        q.device, q.dtype, key_padding_mask=kwargs.get("key_padding_mask") is not None, head_dim=q.shape[-1],
        value_dim=v.shape[-1], mixed_dtypes=not (q.dtype == k.dtype == v.dtype),
    )


# the declarations: one line per op (name and signature from the torch kernel)
causal_latte = Op(latte.causal_latte, _on_values)
causal_latte_chunked = Op(latte.causal_latte_chunked, _on_values)
causal_latte_recurrent = Op(latte.causal_latte_recurrent, _on_values)
causal_latte_step = Op(latte.causal_latte_step, _on_values)
bidirectional_latte = Op(latte.bidirectional_latte, _on_values)
exp_linear_attention = Op(exp_linear.exp_linear_attention, _on_values)
exp_linear_attention_step = Op(exp_linear.exp_linear_attention_step, _on_values)
sliding_window_attention = Op(sliding_window.sliding_window_attention, _window_call)
sliding_window_lse = Op(sliding_window.sliding_window_lse, _on_queries)
sliding_window_attention_with_lse = Op(sliding_window.sliding_window_attention_with_lse, _window_call)
slot_attention_step = Op(slots.slot_attention_step, _on_queries)
masked_dense_attention = Op(slots.masked_dense_attention, _on_queries)
lavo_attention = Op(lavo.lavo_attention, _on_values)
local_attention = Op(lavo.local_attention, _on_values)
orthogonal_memory_attention = Op(lavo.orthogonal_memory_attention, _on_queries)
orthogonal_memory_recurrent = Op(lavo.orthogonal_memory_recurrent, _on_queries)
orthogonal_memory_step = Op(lavo.orthogonal_memory_step, _on_queries)
llp_attention = Op(llp.llp_attention, _on_values)
llp_attention_cached = Op(llp.llp_attention_cached, _on_values)
delta_rule_chunked = Op(delta_rule.delta_rule_chunked, _on_values_and_grad)
delta_rule_step = Op(delta_rule.delta_rule_step, _on_values)
hedgehog_read_chunked = Op(hedgehog.hedgehog_read_chunked, _on_features_and_grad)
hedgehog_read_step = Op(hedgehog.hedgehog_read_step, _on_features_and_grad)
tiered_attention = Op(exact_tier.tiered_attention, _on_queries)

OPS: tuple[Op, ...] = tuple(value for value in list(globals().values()) if isinstance(value, Op))
__all__ = ["OPS", *(op.name for op in OPS)]
