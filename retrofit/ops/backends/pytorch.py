"""The ``torch`` backend: the pure-PyTorch kernels of :mod:`retrofit.ops` (any device, any dtype,
differentiable). It runs every op, so it is what ``auto`` falls back to (lowest priority)."""
from __future__ import annotations

from retrofit.ops import exp_linear, latte, lavo, llp, sliding_window
from retrofit.ops.backends.registry import Backend, register

BACKEND = register(
    Backend(
        name="torch",
        priority=0,
        kernels={
            "causal_latte": latte.causal_latte,
            "causal_latte_chunked": latte.causal_latte_chunked,
            "causal_latte_recurrent": latte.causal_latte_recurrent,
            "causal_latte_step": latte.causal_latte_step,
            "bidirectional_latte": latte.bidirectional_latte,
            "exp_linear_attention": exp_linear.exp_linear_attention,
            "exp_linear_attention_step": exp_linear.exp_linear_attention_step,
            "sliding_window_attention": sliding_window.sliding_window_attention,
            "sliding_window_lse": sliding_window.sliding_window_lse,
            "lavo_attention": lavo.lavo_attention,
            "local_attention": lavo.local_attention,
            "orthogonal_memory_attention": lavo.orthogonal_memory_attention,
            "orthogonal_memory_recurrent": lavo.orthogonal_memory_recurrent,
            "orthogonal_memory_step": lavo.orthogonal_memory_step,
            "llp_attention": llp.llp_attention,
            "llp_attention_cached": llp.llp_attention_cached,
        },
    )
)
