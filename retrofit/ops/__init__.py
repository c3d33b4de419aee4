"""Pure attention math on tensors (no nn.Module state). See each module's docstring for shapes.

Every op here is dispatched: it runs on the backend the registry in :mod:`retrofit.ops.backends`
picks for the call (``backend=`` argument, ``--backend``, ``RETROFIT_BACKEND``, or auto). The
``*_reference`` functions are the dense references the kernels are tested against; the torch
kernels themselves live in the math modules (:mod:`.latte`, :mod:`.sliding_window`, ...) and
are the ``torch`` backend's implementations (the Hedgehog read, :mod:`.hedgehog`, the exact tier,
:mod:`.exact_tier`, and dense attention of a few queries over a decoding cache's key slots or a given key
set, :mod:`.slots`, among them).
The compositions (:mod:`.macchiato`, :mod:`.sinks`) call dispatched ops;
:func:`gqa_sdpa` (SDPA over grouped key/value heads, kept on a fused CUDA kernel),
:func:`capped_rope_attention` (full causal attention with RoPE distances capped, for layers kept
as full attention past their context; SDPA blocks), :func:`linear_cross_entropy`
(an LM head's per-token NLL without whole logits, for evaluation) and :func:`linear_head_losses`
(its training losses, cross-entropy and KL to a teacher, with gradients) are a few device-generic torch
calls with nothing to dispatch.
"""
# the kernels' modules first: the dispatched ops are declared by their torch kernels
from retrofit.ops.delta_rule import DeltaState, delta_rule_reference
from retrofit.ops.exp_linear import exp_linear_attention_reference
from retrofit.ops.latte import LatteState, bidirectional_latte_reference, causal_latte_reference
from retrofit.ops.lavo import (
    LavoState,
    lavo_attention_reference,
    local_attention_reference,
    orthogonal_memory_attention_reference,
)
from retrofit.ops.llp import LLPState, llp_attention_reference
from retrofit.ops.sliding_window import sliding_window_attention_reference
from retrofit.ops import dispatched as _dispatched
from retrofit.ops.dispatched import *  # noqa: F401,F403 - every dispatched op (declared in dispatched.py)
from retrofit.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference
from retrofit.ops.head_loss import linear_head_losses, linear_head_losses_reference
from retrofit.ops.rope import rope_rotate
from retrofit.ops.capped_rope import capped_rope_attention, capped_rope_attention_reference
from retrofit.ops.sinks import (
    FarSinks,
    capped_sink_keys,
    capped_sinks,
    first_valid,
    sink_window_attention,
    sink_window_attention_reference,
)
from retrofit.ops.sdpa import gqa_sdpa, repeat_kv_heads
from retrofit.ops.macchiato import (
    macchiato_attention,
    macchiato_attention_reference,
    macchiato_slot_step,
)

__all__ = [
    *(op.name for op in _dispatched.OPS),
    "DeltaState",
    "LLPState",
    "LatteState",
    "LavoState",
    "lavo_attention_reference",
    "llp_attention_reference",
    "local_attention_reference",
    "orthogonal_memory_attention_reference",
    "capped_rope_attention",
    "capped_rope_attention_reference",
    "bidirectional_latte_reference",
    "causal_latte_reference",
    "delta_rule_reference",
    "exp_linear_attention_reference",
    "macchiato_attention",
    "macchiato_attention_reference",
    "macchiato_slot_step",
    "repeat_kv_heads",
    "gqa_sdpa",
    "FarSinks",
    "capped_sink_keys",
    "capped_sinks",
    "first_valid",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_head_losses",
    "linear_head_losses_reference",
    "rope_rotate",
    "sink_window_attention",
    "sink_window_attention_reference",
    "sliding_window_attention_reference",
]
