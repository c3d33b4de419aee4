"""exp(Q) exp(K)^T causal linear attention (the "linearized attention" blog), stabilised.

``o_t = sum_{s<=t} (phi(q_t) . phi(k_s)) v_s / sum_{s<=t} phi(q_t) . phi(k_s)``, phi = exp
elementwise over the feature dim ``d``.

Identity used here: with the per-feature running log-normaliser
``z_{t,i} = log sum_{s<=t} exp(k_{s,i})`` and the normalised per-feature value mean
``m_{t,i}`` (exactly causal Latte's state with L = d latents and k as latent logits),

    o_t = sum_i softmax_i(q_{t,i} + z_{t,i}) m_{t,i}.

So the op is causal Latte with time-dependent mixing weights, and inherits its stable
chunked and recurrent forms: a per-token shift of q cancels in the softmax, and shifts of
k live in z, carried in the state. Memory of the chunked form is O(T C d) for the
intra-chunk weights and O(T d) otherwise, never O(T d^2).

RoPE and scaling are the caller's choice (the layer applies phi to the pretrained,
rotated and scaled q and k; see ``retrofit.layers``).
Shapes: q, k ``(B, H, T, d)``, v ``(B, H, T, D)``; GQA callers repeat k, v first.
"""
from __future__ import annotations

import torch

from retrofit.ops.latte import LatteState, causal_latte_chunked, causal_latte_step, NEG_INF, _compute_dtype, _finite_or_zero

__all__ = ["exp_linear_attention", "exp_linear_attention_reference", "exp_linear_attention_step"]


def _mixing_weights(q: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    # an empty state (z = -inf on every feature) gives finite weights over a zero state
    return torch.softmax(q + _finite_or_zero(z), dim=-1)


def exp_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int = 64,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LatteState | None]:
    """Chunked exp-linear attention. Returns ``(out (B,H,T,D), final state or None)``."""
    dtype = _compute_dtype(q, k, v)
    a = k.to(dtype)
    if key_padding_mask is not None:
        a = a.masked_fill(~key_padding_mask.bool()[:, None, :, None], NEG_INF)
    z = torch.logcumsumexp(a, dim=2)
    if initial_state is not None:
        z = torch.logaddexp(initial_state.z.to(dtype).unsqueeze(2), z)
    p = _mixing_weights(q.to(dtype), z)
    return causal_latte_chunked(
        p, a, v, chunk_size=chunk_size, key_padding_mask=key_padding_mask,
        initial_state=initial_state, output_final_state=output_final_state,
    )


def exp_linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: LatteState,
    *,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LatteState]:
    """One decoding step: q, k ``(B, H, d)``, v ``(B, H, D)``; O(d D) per head."""
    dtype = _compute_dtype(q, k, v, state.m)
    a = k.to(dtype)
    if valid is not None:
        a = a.masked_fill(~valid.bool()[:, None, None], NEG_INF)
    z_new = torch.logaddexp(state.z.to(dtype), a)
    return causal_latte_step(_mixing_weights(q.to(dtype), z_new), a, v, state, valid=valid)


def exp_linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """O(T^2 d) materialised form (tests only): weights exp(q_t) . exp(k_s) in log space."""
    dtype = _compute_dtype(q, k, v)
    T = q.shape[2]
    logits = torch.logsumexp(q.to(dtype)[:, :, :, None, :] + k.to(dtype)[:, :, None, :, :], dim=-1)  # (B,H,t,s)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.bool()[:, None, None, :]
    probs = torch.softmax(logits.masked_fill(~allowed, NEG_INF), dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs, v.to(dtype))
    if key_padding_mask is not None:
        out = out * key_padding_mask.bool()[:, None, :, None]
    return out.to(v.dtype)
