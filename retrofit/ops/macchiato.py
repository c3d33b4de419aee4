"""Latte Macchiato (Definition 3): sliding-window softmax attention as latent state 0, mixed
with causal Latte over latent states 1..L by p(l|t), normalised over all L + 1 states.

    o_t = p(0|t) * SWA_t(q, k, v) + sum_{l>=1} p(l|t) m_{t,l}

Shapes: q ``(B, Hq, T, d)``, k ``(B, Hkv, P + T, d)``, v ``(B, Hkv, P + T, D)`` (``P =
num_past`` cached window keys before the T new tokens; 0 without a cache), ``mix_logits``
``(B, Hq, T, L + 1)`` (column 0 is the SWA state), ``latent_logits`` ``(B, Hq, T, L)``.
Latent states are per query head; values are shared across a GQA group.

This is the one composition of the two branches (training, prefill and decoding): each branch
is a dispatched op (:mod:`retrofit.ops.dispatched`), so each runs on its own backend.
"""
from __future__ import annotations

import torch

from retrofit.ops.dispatched import causal_latte_chunked, causal_latte_step, sliding_window_attention
from retrofit.ops.latte import LatteState, causal_latte_reference
from retrofit.ops.sinks import FarSinks, sink_window_attention
from retrofit.ops.slots import slot_attention_step
from retrofit.ops.sliding_window import sliding_window_attention_reference

__all__ = ["macchiato_attention", "macchiato_attention_reference", "macchiato_slot_step", "repeat_kv_heads"]


def repeat_kv_heads(x: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """``(B, Hkv, T, D) -> (B, Hq, T, D)``, each KV head repeated over its query group."""
    group = num_query_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def macchiato_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mix_logits: torch.Tensor,
    latent_logits: torch.Tensor | None,
    *,
    window: int,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
    num_past: int = 0,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    q_start: int = 0,
    far_sinks: FarSinks | None = None,
    backend: str | None = "auto",
) -> tuple[torch.Tensor, LatteState | None]:
    """O(T (w d + C L + L D)) Macchiato. Returns ``(out (B, Hq, T, D), latent state or None)``.

    ``key_padding_mask`` ``(B, P + T)``. ``latent_logits=None``: no latent states (L = 0, the
    window alone). ``sinks``: ``(idx, valid, k, v)`` of the attention sinks as
    :func:`retrofit.ops.sinks.first_valid` returns them, with the new tokens' first stream index
    ``q_start`` (see :func:`retrofit.ops.sinks.sink_window_attention`); ``far_sinks``: their capped
    distance (:func:`retrofit.ops.sinks.capped_sinks`). One new token with
    ``output_final_state`` (decoding) takes the Latte step, from an empty state if none is given.
    ``chunk_size=None`` keeps the Latte kernel's own default; ``backend`` goes to both branches.
    """
    p = _mix_weights(mix_logits)
    window_kw = dict(scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, num_past=num_past, backend=backend)
    if sinks is not None:
        idx, valid, sink_k, sink_v = sinks
        swa = sink_window_attention(q, k, v, window, sink_k, sink_v, idx, valid, q_start=q_start, far=far_sinks,
                                    **window_kw)
    else:
        swa = sliding_window_attention(q, k, v, window, **window_kw)
    if latent_logits is None:
        return (p[..., :1] * swa).to(v.dtype), None
    T = q.shape[2]
    v_new = repeat_kv_heads(v[:, :, num_past:], q.shape[1])
    mask_new = None if key_padding_mask is None else key_padding_mask[:, num_past:]
    if T == 1 and output_final_state:
        latent, state = _latent_step(p, latent_logits, v_new, initial_state, mask_new, backend)
    else:
        latent, state = causal_latte_chunked(
            p[..., 1:], latent_logits, v_new, key_padding_mask=mask_new, initial_state=initial_state,
            output_final_state=output_final_state, backend=backend,
            **({} if chunk_size is None else {"chunk_size": chunk_size}),
        )
    return _mix(p, swa, latent, v.dtype), state


def _latent_step(p, latent_logits, v_new, state, valid, backend):
    """One token's latent branch: ``(latent (B, Hq, 1, D), new state)``, from an empty state if None.

    ``v_new`` ``(B, Hq, 1, D)`` (KV heads already repeated), ``valid`` ``(B, 1)`` or None."""
    B, H, D = v_new.shape[0], v_new.shape[1], v_new.shape[-1]
    state = state or LatteState.empty(B, H, latent_logits.shape[-1], D, device=v_new.device)
    latent, state = causal_latte_step(
        p[:, :, 0, 1:], latent_logits[:, :, 0], v_new[:, :, 0], state,
        valid=None if valid is None else valid[:, 0], backend=backend,
    )
    return latent.unsqueeze(2), state


def _mix_weights(mix_logits: torch.Tensor) -> torch.Tensor:
    """``p(l|t)`` over the L + 1 states, in fp32 for half-precision logits."""
    return torch.softmax(mix_logits.float() if mix_logits.dtype in (torch.float16, torch.bfloat16) else mix_logits, dim=-1)


class _GatedAdd(torch.autograd.Function):
    """``latent += gate * swa`` in place, with a backward that takes the gate's gradient as a row dot
    product (no (T, D) temporary): autograd's own backward of ``addcmul_`` writes ``grad * swa``
    and sums it, one more pass over a (T, D) buffer (~10% of Macchiato's backward at 16K).

    latent and swa ``(..., T, D)``, gate ``(..., T, 1)``, all one dtype. Returns ``latent``, which
    comes first: when it is a view, autograd rebases its base's history on the assumption that the
    tensor modified in place is input 0.
    """

    @staticmethod
    def forward(ctx, latent: torch.Tensor, gate: torch.Tensor, swa: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(latent)
        ctx.save_for_backward(gate, swa)
        return latent.addcmul_(gate, swa)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, swa = ctx.saved_tensors
        d_gate = torch.linalg.vecdot(grad, swa).unsqueeze(-1) if ctx.needs_input_grad[1] else None
        d_swa = grad * gate if ctx.needs_input_grad[2] else None
        return grad, d_gate, d_swa


def _mix(p: torch.Tensor, swa: torch.Tensor, latent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``p(0|t) swa + latent`` (the latent output is already weighted by ``p(l|t)``)."""
    if latent.dtype == p.dtype == swa.dtype:  # add the window branch into the latent output in place
        return _GatedAdd.apply(latent, p[..., :1], swa).to(dtype)
    return (p[..., :1] * swa + latent).to(dtype)


def macchiato_slot_step(
    q: torch.Tensor,
    slot_k: torch.Tensor,
    slot_v: torch.Tensor,
    allowed: torch.Tensor,
    v_new: torch.Tensor,
    mix_logits: torch.Tensor,
    latent_logits: torch.Tensor | None,
    state: LatteState | None,
    *,
    valid: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    backend: str | None = "auto",
) -> tuple[torch.Tensor, LatteState | None]:
    """One decoding token with the window and sinks held in key slots.

    ``slot_k``/``slot_v`` ``(B, Hkv, S, d|D)`` and ``allowed`` ``(B, S)`` as in
    :func:`retrofit.ops.slots.slot_attention_step` (the new token already written to its slot);
    ``v_new`` ``(B, Hkv, 1, D)`` the new token's value for the latent step; ``mix_logits``
    ``(B, Hq, 1, L + 1)``, ``latent_logits`` ``(B, Hq, 1, L)`` or None; ``valid`` ``(B, 1)``: a
    padded token outputs zeros and leaves the latent state alone. The same function as
    :func:`macchiato_attention` on one token with the cache's window. Returns
    ``(out (B, Hq, 1, D), new latent state or None)``.
    """
    p = _mix_weights(mix_logits)
    swa = slot_attention_step(q, slot_k, slot_v, allowed, scaling=scaling, softcap=softcap)
    if latent_logits is None:
        out = (p[..., :1] * swa).to(slot_v.dtype)
    else:
        latent, state = _latent_step(p, latent_logits, repeat_kv_heads(v_new, q.shape[1]), state, valid, backend)
        out = _mix(p, swa, latent, slot_v.dtype)
    if valid is not None:  # where, not a product: a padded row may have no allowed slot (NaN)
        out = torch.where(valid[:, None, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out, state


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
