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

from retrofit.ops.dispatched import causal_latte_chunked, causal_latte_step, sliding_window_attention, slot_attention_step
from retrofit.ops.latte import LatteState, causal_latte_reference
from retrofit.ops.sinks import FarSinks, sink_window_attention
from retrofit.ops.sdpa import repeat_kv_heads
from retrofit.ops.sliding_window import sliding_window_attention_reference

__all__ = ["macchiato_attention", "macchiato_attention_reference", "macchiato_slot_step"]


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
    """Latte Macchiato in O(T (w d + C L + L D)): the window attention as state 0 mixed with causal Latte.

    One new token with ``output_final_state`` (decoding) takes the Latte step, from an empty
    state if none is given.

    Args:
        q: ``(B, Hq, T, d)`` queries of the T new tokens.
        k: ``(B, Hkv, P + T, d)`` keys, ``P = num_past`` cached window keys first (``Hq % Hkv == 0``).
        v: ``(B, Hkv, P + T, D)`` values (the latent states read the new tokens' ones).
        mix_logits: ``(B, Hq, T, L + 1)`` logits of p(l|t); column 0 is the window state.
        latent_logits: ``(B, Hq, T, L)`` latent key logits; None: no latent states (the window alone).
        window: ``w``: query t sees keys ``t - w < s <= t``.
        scaling: score scale of the window attention (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` on the window scores when set.
        key_padding_mask: ``(B, P + T)`` bool, True for real tokens; padded queries output 0.
        chunk_size: the Latte kernel's chunk (None keeps its own default).
        initial_state: the latent :class:`LatteState` of the tokens before (None: empty).
        output_final_state: also return the latent state after the last token.
        num_past: ``P``.
        sinks: ``(idx, valid, k, v)`` of the attention sinks as :func:`retrofit.ops.sinks.first_valid`
            returns them (see :func:`retrofit.ops.sinks.sink_window_attention`); None: no sinks.
        q_start: stream position of the first new token (for the sinks).
        far_sinks: the sinks' capped distance (:func:`retrofit.ops.sinks.capped_sinks`).
        backend: goes to both branches.

    Returns:
        ``(out, state)``: ``out`` ``(B, Hq, T, D)`` in ``v.dtype``; the latent :class:`LatteState`
        (m ``(B, Hq, L, D)``) if requested, else None.

    Example:
        >>> import torch
        >>> from retrofit.ops import macchiato_attention
        >>> q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
        >>> mix, lat = torch.randn(1, 4, 20, 3), torch.randn(1, 4, 20, 2)  # L = 2 latent states
        >>> out, state = macchiato_attention(q, k, v, mix, lat, window=8, output_final_state=True)
        >>> out.shape, state.m.shape
        (torch.Size([1, 4, 20, 8]), torch.Size([1, 4, 2, 8]))
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
        if not torch.is_grad_enabled():  # decoding: skip the autograd Function's call overhead
            return latent.addcmul_(p[..., :1], swa).to(dtype)
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

    The same function as :func:`macchiato_attention` on one token with the cache's window.

    Args:
        q: ``(B, Hq, 1, d)`` the new token's query.
        slot_k: ``(B, Hkv, S, d)`` key slots as in :func:`retrofit.ops.slots.slot_attention_step`
            (the new token already written to its slot).
        slot_v: ``(B, Hkv, S, D)`` value slots.
        allowed: ``(B, S)`` bool, the slots the query sees.
        v_new: ``(B, Hkv, 1, D)`` the new token's value for the latent step.
        mix_logits: ``(B, Hq, 1, L + 1)`` logits of p(l|t); column 0 is the window state.
        latent_logits: ``(B, Hq, 1, L)`` or None (no latent states).
        state: the latent :class:`LatteState` before the token (None: empty).
        valid: ``(B, 1)`` bool; a padded token outputs zeros and leaves the latent state alone.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        backend: the window step's and the latent step's backend.

    Returns:
        ``(out, state)``: ``out`` ``(B, Hq, 1, D)`` in ``slot_v.dtype``; the new latent state, or
        None without latent states.

    Example:
        >>> import torch
        >>> from retrofit.ops import macchiato_slot_step
        >>> q, slot_k, slot_v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> allowed = torch.ones(1, 6, dtype=torch.bool)
        >>> mix, lat = torch.randn(1, 4, 1, 3), torch.randn(1, 4, 1, 2)
        >>> out, state = macchiato_slot_step(q, slot_k, slot_v, allowed, slot_v[:, :, -1:], mix, lat, None)
        >>> out.shape, state.m.shape
        (torch.Size([1, 4, 1, 8]), torch.Size([1, 4, 2, 8]))
    """
    p = _mix_weights(mix_logits)
    swa = slot_attention_step(q, slot_k, slot_v, allowed, scaling=scaling, softcap=softcap, backend=backend)
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
    """Dense references of both branches (tests only).

    p(0|t) times the dense window attention, plus the O(T^2) Latte.

    Args:
        q: ``(B, Hq, T, d)`` queries.
        k: ``(B, Hkv, T, d)`` keys (``Hq % Hkv == 0``).
        v: ``(B, Hkv, T, D)`` values.
        mix_logits: ``(B, Hq, T, L + 1)`` logits of p(l|t); column 0 is the window state.
        latent_logits: ``(B, Hq, T, L)`` latent key logits.
        window: ``w``: query t sees keys ``t - w < s <= t``.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, T)`` bool, True for real tokens.

    Returns:
        ``(B, Hq, T, D)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import macchiato_attention_reference
        >>> q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
        >>> mix, lat = torch.randn(1, 4, 20, 3), torch.randn(1, 4, 20, 2)
        >>> macchiato_attention_reference(q, k, v, mix, lat, window=8).shape
        torch.Size([1, 4, 20, 8])
    """
    p = torch.softmax(mix_logits.double(), dim=-1)
    swa = sliding_window_attention_reference(q, k, v, window, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask)
    latent = causal_latte_reference(p[..., 1:], latent_logits, repeat_kv_heads(v, q.shape[1]), key_padding_mask=key_padding_mask)
    return (p[..., :1] * swa.double() + latent.double()).to(v.dtype)
