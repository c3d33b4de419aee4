"""exp(Q) exp(K)^T causal linear attention (the "linearized attention" blog), stabilised.

``o_t = sum_{s<=t} (phi(q_t) . phi(k_s)) v_s / sum_{s<=t} phi(q_t) . phi(k_s)``, phi = exp
elementwise over the feature dim ``d``.

Chunked form (:func:`exp_linear_attention`): the standard chunked linear-attention algorithm
on the shifted feature maps ``Qf_t = exp(q_t + R - c_t)`` and ``Kf_s = exp(k_s - R)``. Per
chunk of C tokens: the masked intra-chunk term ``tril(Qf Kf^T) V``, the carried-state term
``Qf S`` and the update ``S += Kf^T V`` (S ``d x D`` and its normaliser ``n = sum Kf`` per
head). The output ``num / den`` is invariant to both shifts, so they carry no gradient:

* ``R`` ``(d,)`` per head, constant over a chunk: the running per-feature key maximum at
  the chunk end, rounded down to a multiple of ``SHIFT_STEP`` nats. Keys enter relative to
  it (``Kf <= exp(SHIFT_STEP)``, nothing overflows); it only moves when the running maximum
  crosses a grid line, and then the carried state is rescaled by ``exp(R_old - R_new) <= 1``
  (k's shift is carried in the state, as Latte carries its log-normaliser).
* ``c_t = max_i (q_{t,i} + R_i)`` per token: a per-token shift of q cancels in the ratio;
  with it ``Qf <= 1``. Where a key inside a chunk exceeds every earlier key of its feature
  by more than ``SHIFT_STEP`` (always in the first chunk), earlier queries of the chunk would
  see their dominant terms scaled by ``exp(-jump)``; there ``c_t`` is the exact
  ``max_{i, s<=t} (q_{t,i} + k_{s,i})`` (a causal running maximum), so the denominator is
  >= 1 and ``Qf <= exp(jump)``, capped at ``exp(MAX_QUERY_GAIN)``.

Every sum is of positive terms, so the only failure left is underflow for jumps beyond
``MAX_QUERY_GAIN`` nats inside one chunk. The forward measures it exactly (a valid query's
denominator, in units of ``exp(c_t)``, below ``MIN_DENOMINATOR``) and then answers with the
log-space form (:func:`_exp_linear_latte_form`, causal Latte with d latents; exact
for any logit spread, O(T d) more memory). Gradients of an ``initial_state`` and of the
returned final state also take that form.

Memory of the chunked form: O(T d + T C + d D) per head; backward recomputes the chunk
states (one forward sweep for dQ, one reverse sweep of the state gradient for dK, dV)
instead of storing T / C of them.

The decoding state is :class:`LatteState` with ``L = d``: ``z_i = log sum_s exp(k_{s,i})``
and ``m_i = sum_s exp(k_{s,i}) v_s / exp(z_i)``; the chunked form converts at its ends.
RoPE and scaling are the caller's choice (the layer applies phi to the pretrained,
rotated and scaled q and k; see ``retrofit.layers``).
Shapes: q, k ``(B, H, T, d)``, v ``(B, H, T, D)``; GQA callers repeat k, v first.
"""
from __future__ import annotations

import torch

from retrofit.ops._common import compute_dtype
from retrofit.ops.latte import (
    NEG_INF, LatteState, causal_latte_chunked, causal_latte_step, finite_or_zero, masked_logits,
)

__all__ = ["exp_linear_attention", "exp_linear_attention_reference", "exp_linear_attention_step"]

# Grid (nats) of the per-feature key shift R: keys enter as exp(k - R) <= exp(SHIFT_STEP).
SHIFT_STEP = 10.0
# A valid query whose denominator (units of exp(c_t), exactly >= 1 without in-chunk jumps)
# falls below this sends the call to the log-space form; above it, terms lost to underflow
# are < d * T * exp(SHIFT_STEP) * 1e-38 / MIN_DENOMINATOR relative, far below fp32 resolution.
MIN_DENOMINATOR = 1e-10
# Largest query factor exp(q + R - c_t) allowed in chunks where keys jump (see _query_shift).
MAX_QUERY_GAIN = 60.0


def _mixing_weights(q: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    # an empty state (z = -inf on every feature) gives finite weights over a zero state
    return torch.softmax(q + finite_or_zero(z), dim=-1)


def exp_linear_weights(
    q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None, initial_state: LatteState | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """exp-linear attention as causal Latte inputs, in ``dtype``: ``(p, a)``, the mixing weights
    ``softmax_i(q_ti + z_ti)`` ``(B, H, T, d)`` (``z`` the running log-normaliser, continuing
    ``initial_state``) and the key logits ``a = k`` ``(B, H, T, d)``, -inf at padded tokens."""
    a = masked_logits(k, key_padding_mask, dtype)
    z = torch.logcumsumexp(a, dim=2)
    if initial_state is not None:
        z = torch.logaddexp(initial_state.z.to(dtype).unsqueeze(2), z)
    return _mixing_weights(q.to(dtype), z), a


def _exp_linear_latte_form(q, k, v, *, chunk_size, key_padding_mask, initial_state, output_final_state):
    """Log-space form: causal Latte with L = d latents and mixing weights softmax(q_t + z_t).

    Exact for any logit spread (every exponent <= 0) but holds (T, d) log-normalisers and
    weights per head; the chunked form's fallback and the path for differentiable states.
    """
    p, a = exp_linear_weights(q, k, key_padding_mask, initial_state, compute_dtype(q, k, v))
    return causal_latte_chunked(
        p, a, v, chunk_size=chunk_size, key_padding_mask=key_padding_mask,
        initial_state=initial_state, output_final_state=output_final_state,
    )


def _chunked(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """(B, H, n*C, F) -> (B*H, n, C, F), a view where possible (chunk c of every head: ``[:, c]``)."""
    B, H, _, F = x.shape
    return x.reshape(B * H, n, C, F)


class _ExpLinearChunked(torch.autograd.Function):
    """Chunked exp-linear attention on prepared, padded inputs (see the module docstring).

    Inputs (all in the compute dtype): q, k ``(B, H, n*C, d)`` with padded keys at -inf,
    v ``(B, H, n*C, D)``, valid ``(B, H, n*C)`` bool or None, m0 ``(B*H, d, D)`` and z0
    ``(B*H, d)`` the initial state (constants). Returns the output ``(B, H, n*C, D)``, a
    0-dim bool "every denominator safe", and the final (m, z) (non-differentiable).
    Per-chunk slices ``x[:, c]`` are strided batches; the GEMMs take them without copies.
    """

    @staticmethod
    def _shifts(kc: torch.Tensor, z0: torch.Tensor):
        """Running per-feature key maximum at each chunk end ``(BH, n, d)`` and before it,
        the key shift R ``(BH, n, 1, d)`` (safe: -inf -> 0), the state rescale f ``(BH, n, d)``
        and the chunks where f differs from 1."""
        running = torch.cummax(torch.maximum(kc.amax(dim=2), z0.unsqueeze(1)), dim=1).values  # (BH, n, d)
        before = torch.cat([z0.unsqueeze(1), running[:, :-1]], dim=1)
        R = torch.floor(running / SHIFT_STEP) * SHIFT_STEP
        prev = torch.cat([z0.unsqueeze(1), R[:, :-1]], dim=1)
        # an empty feature (prev = -inf) has a zero state: leave it (f = 1)
        f = torch.exp(torch.where(prev == NEG_INF, R, prev) - R).nan_to_num_(1.0)
        moved = (f != 1.0).any(dim=2).any(dim=0).tolist()
        return running, before, finite_or_zero(R).unsqueeze(2), f, moved

    @staticmethod
    def _query_shift(qR: torch.Tensor, kc: torch.Tensor, R: torch.Tensor, running: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """c_t ``(BH, n, C, 1)`` from ``qR = q + R``: ``max_i (q_ti + R_i)`` (then Qf <= 1), except
        in chunks where a feature's running key maximum jumps by more than SHIFT_STEP: there
        the exact ``max_i (q_ti + M_ti)`` over the causal running maximum M_t (denominator >= 1),
        capped so that Qf <= exp(MAX_QUERY_GAIN)."""
        shift = qR.amax(dim=-1, keepdim=True)
        jump = (running - before).amax(dim=2).amax(dim=0)  # (n,), +inf where nothing came before
        idx = (jump > SHIFT_STEP).nonzero().squeeze(-1)
        if idx.numel():
            m_t = torch.maximum(torch.cummax(kc.index_select(1, idx), dim=2).values, before.index_select(1, idx).unsqueeze(2))
            exact = (qR.index_select(1, idx) - R.index_select(1, idx) + m_t).amax(dim=-1, keepdim=True)
            shift.index_copy_(1, idx, torch.maximum(exact, shift.index_select(1, idx) - MAX_QUERY_GAIN))
        return shift

    @staticmethod
    def _initial(m0: torch.Tensor, z0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """State (S, n) relative to the shift z0: S = m0, n = 1 (0 for an empty feature)."""
        has = z0 != NEG_INF
        return torch.where(has.unsqueeze(-1), m0, 0.0), has.to(m0.dtype)

    @staticmethod
    def forward(ctx, q, k, v, valid, m0, z0, C: int):
        B, H, Tp, d = q.shape
        D = v.shape[-1]
        n = Tp // C
        kc = _chunked(k, n, C)  # (BH, n, C, d)
        running, before, R, f, moved = _ExpLinearChunked._shifts(kc, z0)
        Qf = _chunked(q, n, C) + R
        Qf.sub_(_ExpLinearChunked._query_shift(Qf, kc, R, running, before)).exp_()
        Kf = torch.exp(kc - R)
        V = _chunked(v, n, C)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()

        W = torch.matmul(Qf, Kf.transpose(-1, -2)).masked_fill_(~causal, 0.0)  # (BH, n, C, C)
        den = W.sum(-1)  # (BH, n, C)
        num = torch.matmul(W, V)  # (BH, n, C, D)
        del W
        ksum = Kf.sum(2)  # (BH, n, d)
        S, nrm = _ExpLinearChunked._initial(m0, z0)
        n_start = torch.empty_like(ksum)
        for c in range(n):
            if moved[c]:
                S.mul_(f[:, c].unsqueeze(-1))
                nrm.mul_(f[:, c])
            n_start[:, c] = nrm
            num[:, c].baddbmm_(Qf[:, c], S)
            S.baddbmm_(Kf[:, c].transpose(1, 2), V[:, c])
            nrm.add_(ksum[:, c])
        den.unsqueeze(-1).add_(torch.matmul(Qf, n_start.unsqueeze(-1)))
        vmask = torch.ones_like(den, dtype=torch.bool) if valid is None else valid.reshape(B * H, n, C)
        ok = bool(((den >= MIN_DENOMINATOR) & torch.isfinite(den))[vmask].all())
        den_safe = torch.where(vmask & (den > 0), den, 1.0)
        out = num.div_(den_safe.unsqueeze(-1)).masked_fill_(~vmask.unsqueeze(-1), 0.0)

        z_end = torch.where(nrm > 0, R[:, -1, 0] + torch.log(nrm), NEG_INF)
        m_end = S / torch.where(nrm > 0, nrm, 1.0).unsqueeze(-1)
        ctx.save_for_backward(Qf, Kf, V, out, den_safe, vmask, f, m0, z0)
        ctx.moved, ctx.C, ctx.shape = moved, C, (B, H, Tp, d, D)
        ctx.mark_non_differentiable(m_end, z_end)
        return out.view(B, H, Tp, D), torch.tensor(ok), m_end, z_end

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _ok, _m, _z):
        Qf, Kf, V, out, den, vmask, f, m0, z0 = ctx.saved_tensors
        moved, C, (B, H, Tp, d, D) = ctx.moved, ctx.C, ctx.shape
        n = Tp // C
        # o = num / den on valid rows (masked rows are the constant 0: no gradient)
        G = (_chunked(grad_out.to(out.dtype), n, C) / den.unsqueeze(-1)).masked_fill_(~vmask.unsqueeze(-1), 0.0)  # d num
        g0 = -(G * out).sum(-1)  # d den  (BH, n, C)
        causal = torch.ones(C, C, dtype=torch.bool, device=Qf.device).tril()

        dW = torch.matmul(G, V.transpose(-1, -2)).add_(g0.unsqueeze(-1)).masked_fill_(~causal, 0.0)
        dQf = torch.matmul(dW, Kf)
        dKf = torch.matmul(dW.transpose(-1, -2), Qf)
        del dW
        W = torch.matmul(Qf, Kf.transpose(-1, -2)).masked_fill_(~causal, 0.0)
        dV = torch.matmul(W.transpose(-1, -2), G)
        del W

        ksum = Kf.sum(2)
        S, nrm = _ExpLinearChunked._initial(m0, z0)
        n_start = torch.empty_like(ksum)
        for c in range(n):  # forward sweep: the state each chunk's queries read
            if moved[c]:
                S.mul_(f[:, c].unsqueeze(-1))
                nrm.mul_(f[:, c])
            n_start[:, c] = nrm
            dQf[:, c].baddbmm_(G[:, c], S.transpose(1, 2))
            S.baddbmm_(Kf[:, c].transpose(1, 2), V[:, c])
            nrm.add_(ksum[:, c])
        del S
        dQf.add_(g0.unsqueeze(-1) * n_start.unsqueeze(2))
        qg0 = torch.matmul(Qf.transpose(-1, -2), g0.unsqueeze(-1)).squeeze(-1)  # (BH, n, d): each chunk's d n
        dS = torch.zeros_like(m0)  # gradient of the state at the end of chunk c
        dn = torch.zeros_like(z0)
        dn_end = torch.empty_like(ksum)
        for c in reversed(range(n)):  # reverse sweep: state gradient
            dn_end[:, c] = dn
            dKf[:, c].baddbmm_(V[:, c], dS.transpose(1, 2))
            dV[:, c].baddbmm_(Kf[:, c], dS)
            dS.baddbmm_(Qf[:, c].transpose(1, 2), G[:, c])
            dn.add_(qg0[:, c])
            if moved[c]:
                dS.mul_(f[:, c].unsqueeze(-1))
                dn.mul_(f[:, c])
        dKf.add_(dn_end.unsqueeze(2))
        dq = dQf.mul_(Qf).view(B, H, Tp, d)
        dk = dKf.mul_(Kf).view(B, H, Tp, d)
        return dq, dk, dV.view(B, H, Tp, D), None, None, None, None


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
    """Chunked exp-linear attention: O(T C d + T d D) time and O(T d + T C + d D) memory per head.

    See the module docstring for the stabilisation and when the log-space form answers instead.

    Args:
        q: ``(B, H, T, d)`` queries (the feature map exp is applied here).
        k: ``(B, H, T, d)`` keys (GQA callers repeat them first).
        v: ``(B, H, T, D)`` values.
        chunk_size: tokens per chunk ``C``.
        key_padding_mask: ``(B, T)`` bool, True for real tokens; padded positions output 0.
        initial_state: a :class:`LatteState` with ``L = d`` to continue from (None: empty).
        output_final_state: also return the state after the last token.

    Returns:
        ``(out, state)``: ``out`` ``(B, H, T, D)`` in ``v.dtype``; the final :class:`LatteState`
        (m ``(B, H, d, D)``, z ``(B, H, d)``) if requested, else None.

    Example:
        >>> import torch
        >>> from retrofit.ops import exp_linear_attention
        >>> q, k, v = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 8)
        >>> out, state = exp_linear_attention(q, k, v, chunk_size=4, output_final_state=True)
        >>> out.shape, state.m.shape
        (torch.Size([1, 2, 10, 8]), torch.Size([1, 2, 4, 8]))
    """
    B, H, T, d = q.shape
    D = v.shape[-1]
    dtype = compute_dtype(q, k, v)
    wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    state_grad = torch.is_grad_enabled() and (
        (initial_state is not None and (initial_state.m.requires_grad or initial_state.z.requires_grad))
        or (output_final_state and wants_grad)
    )
    args = dict(chunk_size=chunk_size, key_padding_mask=key_padding_mask,
                initial_state=initial_state, output_final_state=output_final_state)
    if T == 0 or state_grad:
        return _exp_linear_latte_form(q, k, v, **args)
    C = max(1, min(int(chunk_size), T))
    n = -(-T // C)
    pad = n * C - T
    qq, kk, vv = q.to(dtype), k.to(dtype), v.to(dtype)
    valid = None
    if key_padding_mask is not None:
        valid = key_padding_mask.bool()[:, None, :].expand(B, H, T)
        kk = kk.masked_fill(~valid.unsqueeze(-1), NEG_INF)
    if pad:
        qq = torch.nn.functional.pad(qq, (0, 0, 0, pad))
        kk = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=NEG_INF)
        vv = torch.nn.functional.pad(vv, (0, 0, 0, pad))
        valid = torch.nn.functional.pad(
            valid if valid is not None else q.new_ones(B, H, T, dtype=torch.bool), (0, pad), value=False
        )
    if initial_state is None:
        m0 = qq.new_zeros(B * H, d, D)
        z0 = qq.new_full((B * H, d), NEG_INF)
    else:
        m0 = initial_state.m.to(dtype).reshape(B * H, d, D)
        z0 = initial_state.z.to(dtype).reshape(B * H, d)
    out, ok, m_end, z_end = _ExpLinearChunked.apply(qq, kk, vv, valid, m0, z0, C)
    if not bool(ok):
        return _exp_linear_latte_form(q, k, v, **args)
    final = None
    if output_final_state:
        final = LatteState(m=m_end.view(B, H, d, D), z=z_end.view(B, H, d))
    return out[:, :, :T].to(v.dtype), final


def exp_linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: LatteState,
    *,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LatteState]:
    """One decoding step of exp-linear attention: O(d D) per head.

    Args:
        q: ``(B, H, d)`` the new token's query.
        k: ``(B, H, d)`` its key.
        v: ``(B, H, D)`` its value.
        state: the :class:`LatteState` (``L = d``) before the token.
        valid: ``(B,)`` bool; rows marked False (padding) leave the state untouched and output 0.

    Returns:
        ``(out, state)``: ``out`` ``(B, H, D)`` in ``v.dtype``; the state after the token.

    Example:
        >>> import torch
        >>> from retrofit.ops import LatteState, exp_linear_attention_step
        >>> state = LatteState.empty(1, 2, 4, 8)
        >>> q, k, v = torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 8)
        >>> out, state = exp_linear_attention_step(q, k, v, state)
        >>> out.shape
        torch.Size([1, 2, 8])
    """
    dtype = compute_dtype(q, k, v, state.m)
    a = masked_logits(k, valid, dtype)
    z_new = torch.logaddexp(state.z.to(dtype), a)
    return causal_latte_step(_mixing_weights(q.to(dtype), z_new), a, v, state, valid=valid)


def exp_linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """O(T^2 d) materialised form (tests only): weights exp(q_t) . exp(k_s) in log space.

    Args:
        q: ``(B, H, T, d)`` queries.
        k: ``(B, H, T, d)`` keys.
        v: ``(B, H, T, D)`` values.
        key_padding_mask: ``(B, T)`` bool, True for real tokens; padded queries output 0.

    Returns:
        ``(B, H, T, D)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import exp_linear_attention_reference
        >>> q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 8)
        >>> exp_linear_attention_reference(q, k, v).shape
        torch.Size([1, 2, 6, 8])
    """
    dtype = compute_dtype(q, k, v)
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
