"""Pure attention math on tensors (no nn.Module state). See each module's docstring for shapes.

Every op here is dispatched: it runs on the backend the registry in :mod:`retrofit.ops.backends`
picks for the call (``backend=`` argument, ``--backend``, ``RETROFIT_BACKEND``, or auto). The
``*_reference`` functions are the dense references the kernels are tested against; the torch
kernels themselves live in the math modules (:mod:`.latte`, :mod:`.sliding_window`, ...) and
are the ``torch`` backend's implementations. The compositions (:mod:`.macchiato`, :mod:`.sinks`)
call dispatched ops; :func:`slot_attention_step` (one decoding query over preallocated key
slots), :func:`capped_rope_attention` (full causal attention with RoPE distances capped, for
layers kept as full attention past their context; SDPA blocks), :func:`linear_cross_entropy`
(an LM head's per-token NLL without whole logits, for evaluation) and :func:`linear_head_losses`
(its training losses, cross-entropy and KL to a teacher, with gradients) are a few device-generic torch
calls with nothing to dispatch.
"""
# the kernels' modules first: the backends register their kernels from them
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
from retrofit.ops.dispatched import (
    bidirectional_latte,
    causal_latte,
    causal_latte_chunked,
    causal_latte_recurrent,
    causal_latte_step,
    exp_linear_attention,
    exp_linear_attention_step,
    lavo_attention,
    llp_attention,
    llp_attention_cached,
    local_attention,
    orthogonal_memory_attention,
    orthogonal_memory_recurrent,
    orthogonal_memory_step,
    sliding_window_attention,
    sliding_window_lse,
)
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
from retrofit.ops.slots import slot_attention_step
from retrofit.ops.macchiato import (
    macchiato_attention,
    macchiato_attention_reference,
    macchiato_slot_step,
    repeat_kv_heads,
)

__all__ = [
    "LLPState",
    "LatteState",
    "LavoState",
    "lavo_attention",
    "lavo_attention_reference",
    "llp_attention",
    "llp_attention_cached",
    "llp_attention_reference",
    "local_attention",
    "local_attention_reference",
    "orthogonal_memory_attention",
    "orthogonal_memory_attention_reference",
    "orthogonal_memory_recurrent",
    "orthogonal_memory_step",
    "bidirectional_latte",
    "capped_rope_attention",
    "capped_rope_attention_reference",
    "bidirectional_latte_reference",
    "causal_latte",
    "causal_latte_chunked",
    "causal_latte_recurrent",
    "causal_latte_reference",
    "causal_latte_step",
    "exp_linear_attention",
    "exp_linear_attention_reference",
    "exp_linear_attention_step",
    "macchiato_attention",
    "macchiato_attention_reference",
    "macchiato_slot_step",
    "repeat_kv_heads",
    "slot_attention_step",
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
    "sliding_window_attention",
    "sliding_window_attention_reference",
    "sliding_window_lse",
]
