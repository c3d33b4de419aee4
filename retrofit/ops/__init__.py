"""Pure attention math on tensors (no nn.Module state). See each module's docstring for shapes."""
from retrofit.ops.exp_linear import exp_linear_attention, exp_linear_attention_reference, exp_linear_attention_step
from retrofit.ops.lavo import (
    LavoState,
    lavo_attention,
    lavo_attention_reference,
    local_attention,
    local_attention_reference,
    orthogonal_memory_attention,
    orthogonal_memory_attention_reference,
    orthogonal_memory_recurrent,
    orthogonal_memory_step,
)
from retrofit.ops.llp import LLPState, llp_attention, llp_attention_cached, llp_attention_reference
from retrofit.ops.latte import (
    LatteState,
    bidirectional_latte,
    bidirectional_latte_reference,
    causal_latte,
    causal_latte_chunked,
    causal_latte_recurrent,
    causal_latte_reference,
    causal_latte_step,
)
from retrofit.ops.macchiato import macchiato_attention, macchiato_attention_reference, repeat_kv_heads
from retrofit.ops.sinks import first_valid, sink_window_attention, sink_window_attention_reference
from retrofit.ops.sliding_window import sliding_window_attention, sliding_window_attention_reference, sliding_window_lse

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
    "repeat_kv_heads",
    "first_valid",
    "sink_window_attention",
    "sink_window_attention_reference",
    "sliding_window_attention",
    "sliding_window_attention_reference",
    "sliding_window_lse",
]
