"""Latte Macchiato (Definition 3): sliding-window softmax attention as latent state 0, mixed
with causal Latte over latent states 1..L by p(l|t), normalised over all L + 1 states.

    o_t = p(0|t) * SWA_t(q, k, v) + sum_{l>=1} p(l|t) m_{t,l}

Shapes: q ``(B, Hq, T, d)``, k ``(B, Hkv, T, d)``, v ``(B, Hkv, T, D)``,
``mix_logits`` ``(B, Hq, T, L + 1)`` (column 0 is the SWA state), ``latent_logits``
``(B, Hq, T, L)``. Latent states are per query head; values are shared across a GQA group.
"""
from __future__ import annotations

import torch

from retrofit.ops.latte import LatteState, causal_latte_chunked, causal_latte_reference
from retrofit.ops.sliding_window import sliding_window_attention, sliding_window_attention_reference

__all__ = ["macchiato_attention", "macchiato_attention_reference", "repeat_kv_heads"]


def repeat_kv_heads(x: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """``(B, Hkv, T, D) -> (B, Hq, T, D)``, each KV head repeated over its query group."""
    group = num_query_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


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
    chunk_size: int = 128,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LatteState | None]:
    """O(T (w d + C L + L D)) Macchiato. Returns ``(out (B, Hq, T, D), latent state or None)``."""
    p = torch.softmax(mix_logits.float() if mix_logits.dtype in (torch.float16, torch.bfloat16) else mix_logits, dim=-1)
    swa = sliding_window_attention(q, k, v, window, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask)
    latent, state = causal_latte_chunked(
        p[..., 1:], latent_logits, repeat_kv_heads(v, q.shape[1]), chunk_size=chunk_size,
        key_padding_mask=key_padding_mask, initial_state=initial_state, output_final_state=output_final_state,
    )
    if latent.dtype == p.dtype:  # add the window branch into the latent output in place (no T x D temporary)
        return latent.addcmul_(p[..., :1], swa), state
    return (p[..., :1] * swa + latent).to(v.dtype), state


def macchiato_attention_reference(
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
) -> torch.Tensor:
    """Dense references of both branches (tests only)."""
    p = torch.softmax(mix_logits.double(), dim=-1)
    swa = sliding_window_attention_reference(q, k, v, window, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask)
    latent = causal_latte_reference(p[..., 1:], latent_logits, repeat_kv_heads(v, q.shape[1]), key_padding_mask=key_padding_mask)
    return (p[..., :1] * swa.double() + latent.double()).to(v.dtype)
