"""Latte: latent attention (Dolga, Maystre, Cobzarenco and Barber 2024, Definitions 1-2) in reference, chunked and recurrent forms.

Notation per head: ``L`` latent states, ``D`` value dim, ``T`` tokens.

* ``q_weights`` ``(B, H, T, L)``: non-negative mixing weights over latents, p(l|t) for plain
  Latte (``softmax`` of the query logits). Macchiato passes the latent part of a softmax
  over ``L + 1`` states, so the weights need not sum to one.
* ``k_logits`` ``(B, H, T, L)``: a_{t,l}, the latent key logits; p(s|l,t) = softmax over s <= t.
* ``v`` ``(B, H, T, D)``.

Causal Latte output: ``o_t = sum_l q_{t,l} m_{t,l}`` with
``m_{t,l} = sum_{s<=t} exp(a_{s,l}) v_s / sum_{s<=t} exp(a_{s,l})``. With the running
log-normaliser ``z_t = logcumsumexp_s a_s`` this is the gated recurrence
``m_t = exp(z_{t-1} - z_t) m_{t-1} + exp(a_t - z_t) v_t`` (paper eq. 19 in log space).

Numerics: every exponent evaluated here is of the form ``a_s - z_t`` or ``z_s - z_t`` with
``s <= t``, hence <= 0: nothing overflows whatever the logit spread, and terms that
underflow are below fp32 resolution of the result. Internal math runs in at least fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retrofit.ops._common import compute_dtype

__all__ = [
    "LatteState",
    "causal_latte",
    "causal_latte_reference",
    "causal_latte_chunked",
    "causal_latte_recurrent",
    "causal_latte_step",
    "bidirectional_latte",
    "bidirectional_latte_reference",
]

NEG_INF = float("-inf")
NO_GRAD_STATE_BYTES = 64 << 20  # without autograd, chunk-start states of at most this many bytes exist at once
# the chunk-state scan as one batched GEMM when its (B, H, L, n + 1, n) weights have at most this many
# elements (64 MiB in fp32; autograd keeps a few such tensors per layer until the backward) and the
# scan would otherwise be a Python loop of many small kernels (autograd, or a GPU)
SCAN_MATMUL_MAX_ELEMENTS = 1 << 24


@dataclass
class LatteState:
    """Recurrent state of causal Latte for one layer.

    m: ``(B, H, L, D)`` value mean per latent, normalised at z (bounded by max |v|).
    z: ``(B, H, L)`` log-normaliser ``log sum_s exp(a_s)``; ``-inf`` before any token.
    """

    m: torch.Tensor
    z: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, latents: int, dim: int, *, device=None, dtype=torch.float32) -> "LatteState":
        return cls(
            m=torch.zeros(batch, heads, latents, dim, device=device, dtype=dtype),
            z=torch.full((batch, heads, latents), NEG_INF, device=device, dtype=dtype),
        )

    def detach(self) -> "LatteState":
        return LatteState(self.m.detach(), self.z.detach())

    def index_select(self, batch_index: torch.Tensor) -> "LatteState":
        return LatteState(self.m.index_select(0, batch_index), self.z.index_select(0, batch_index))


def finite_or_zero(z: torch.Tensor) -> torch.Tensor:
    """Replace -inf log-normalisers (empty state) by 0 so that ``x - z`` never is ``-inf - -inf``."""
    return z.masked_fill(z == NEG_INF, 0.0)


def masked_logits(k_logits: torch.Tensor, valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Key logits ``(B, H, T, L)`` (or one token's, ``(B, H, L)``) in ``dtype``, -inf at padded tokens:
    ``valid`` ``(B, T)`` (or ``(B,)``) bool, True for real tokens (None: all real)."""
    a = k_logits.to(dtype)
    if valid is not None:
        a = a.masked_fill(~valid.bool()[:, None, ..., None], NEG_INF)
    return a


# --------------------------------------------------------------------------------------
# reference


def causal_latte_reference(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Direct O(T^2 L) evaluation of Definition 2 (tests only).

    Args:
        q_weights: ``(B, H, T, L)`` non-negative mixing weights p(l|t) over the latents.
        k_logits: ``(B, H, T, L)`` latent key logits a_{t,l}.
        v: ``(B, H, T, D)`` values.
        key_padding_mask: ``(B, T)`` bool, True for real tokens; padded keys are never read and
            padded queries output 0.

    Returns:
        ``(B, H, T, D)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import causal_latte_reference
        >>> q = torch.softmax(torch.randn(1, 2, 10, 4), dim=-1)
        >>> causal_latte_reference(q, torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 8)).shape
        torch.Size([1, 2, 10, 8])
    """
    dtype = compute_dtype(q_weights, k_logits, v)
    T = v.shape[-2]
    a = masked_logits(k_logits, key_padding_mask, dtype)  # (B,H,T,L)
    causal = torch.ones(T, T, dtype=torch.bool, device=v.device).tril()  # [t, s]
    logits = a.transpose(-1, -2)[..., None, :].expand(*a.shape[:2], a.shape[-1], T, T)  # (B,H,L,t,s)
    logits = logits.masked_fill(~causal, NEG_INF)
    p_s = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no valid key -> 0
    out = torch.einsum("bhtl,bhlts,bhsd->bhtd", q_weights.to(dtype), p_s, v.to(dtype))
    if key_padding_mask is not None:
        out = out * key_padding_mask.bool()[:, None, :, None]
    return out.to(v.dtype)


# --------------------------------------------------------------------------------------
# chunked


class _IntraChunkWeights(torch.autograd.Function):
    """W[n, t, s] = sum_l q[n,t,l] exp(a[n,s,l] - z[n,t,l]) for s <= t, else 0.

    Evaluated pairwise in log space (exponents <= 0) in slices so the ``(N, C, C, L)``
    intermediate is never held whole; backward recomputes it instead of storing it.
    """

    SLICE_ELEMENTS = 1 << 23

    @staticmethod
    def _exp_pairs(a: torch.Tensor, z: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        expo = a[:, None, :, :] - z[:, :, None, :]  # (n, t, s, l)
        return torch.exp(expo.masked_fill(~causal[None, :, :, None], NEG_INF))

    @staticmethod
    def forward(ctx, q: torch.Tensor, a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        N, C, L = q.shape
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        step = max(1, _IntraChunkWeights.SLICE_ELEMENTS // (C * C * L))
        out = q.new_empty(N, C, C)
        for i in range(0, N, step):
            e = _IntraChunkWeights._exp_pairs(a[i : i + step], z[i : i + step], causal)
            out[i : i + step] = torch.einsum("ntl,ntsl->nts", q[i : i + step], e)
        ctx.save_for_backward(q, a, z)
        return out

    @staticmethod
    def backward(ctx, grad_w: torch.Tensor):
        q, a, z = ctx.saved_tensors
        N, C, L = q.shape
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        step = max(1, _IntraChunkWeights.SLICE_ELEMENTS // (C * C * L))
        dq, da, dz = torch.empty_like(q), torch.empty_like(a), torch.empty_like(z)
        for i in range(0, N, step):
            sl = slice(i, i + step)
            e = _IntraChunkWeights._exp_pairs(a[sl], z[sl], causal)
            ge = grad_w[sl][..., None] * e  # (n, t, s, l)
            dq[sl] = ge.sum(2)
            r = ge * q[sl][:, :, None, :]
            da[sl] = r.sum(1)
            dz[sl] = -r.sum(2)
        return dq, da, dz


# Largest growth (nats) of the log-normaliser inside one chunk for which the factorised matmul
# form is used: the query factor exp(z_end - z_t) is then at most exp(40), far from fp32's range,
# and the key factor exp(a_s - z_end) of every term that matters is resolved. Chunks above it
# (abrupt huge logits) take the exact pairwise form.
FACTORISED_MAX_RANGE = 40.0
_MIN_SHARE = math.exp(-FACTORISED_MAX_RANGE)


def _scan_chunk_states(
    contrib: torch.Tensor, decay: torch.Tensor, m_init: torch.Tensor, z_bound: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-start states: ``m[c + 1] = decay[c] m[c] + contrib[c]`` from ``m[0] = m_init``.

    contrib ``(B,H,n,L,D)``: each chunk's value sum normalised at its own end; decay ``(B,H,n,L)``
    = exp(z_start - z_end) <= 1; m_init ``(B,H,L,D)``; z_bound ``(B,H,n + 1,L)`` the log-normaliser
    at each chunk boundary (z_init, then every chunk's end). Returns ``(m_start (B,H,n,L,D), m_final)``.

    Two forms of the same recurrence. Unrolled, the state at boundary c is
    ``sum_{j<c} exp(z_end[j] - z_bound[c]) contrib[j] + exp(z_init - z_bound[c]) m_init`` (the
    decays telescope), every exponent <= 0: one batched (n + 1, n) @ (n, D) GEMM per (B, H, L),
    which autograd and a GPU run as a handful of kernels. Otherwise (a CPU without autograd, or
    weights larger than ``SCAN_MATMUL_MAX_ELEMENTS``) n steps on (L, D) states: O(n L D) work.
    """
    B, H, n, L, D = contrib.shape
    tracked = torch.is_grad_enabled() and any(x.requires_grad for x in (contrib, decay, m_init))
    if (tracked or contrib.device.type != "cpu") and B * H * L * (n + 1) * n <= SCAN_MATMUL_MAX_ELEMENTS:
        return _scan_by_matmul(contrib, m_init, z_bound)
    m = m_init
    if tracked:  # out-of-place steps, stacked; unbind (not indexing) keeps the backward O(n)
        starts = []
        for u, g in zip(contrib.unbind(2), decay.unsqueeze(-1).unbind(2)):
            starts.append(m)
            m = torch.addcmul(u, g, m)
        return torch.stack(starts, dim=2), m
    m_start = torch.empty_like(contrib)
    for c in range(n):
        m_start[:, :, c] = m
        m = torch.addcmul(contrib[:, :, c], decay[:, :, c, :, None], m)
    return m_start, m


def _scan_by_matmul(contrib: torch.Tensor, m_init: torch.Tensor, z_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_scan_chunk_states` unrolled (see there): the states at all n + 1 boundaries at once.

    A chunk that saw no key yet (z_end = -inf) has a zero contribution and gets weight 0, as does a
    boundary before any key; boundary 0 is m_init itself."""
    n = contrib.shape[2]
    known = torch.isfinite(z_bound)
    causal = torch.ones(n + 1, n, dtype=torch.bool, device=contrib.device).tril(-1)  # boundary c after chunk j
    dead = ~(causal[None, None, :, :, None] & known[:, :, :, None] & known[:, :, None, 1:])  # (B,H,n+1,n,L)
    # exponents <= 0 where live; dead entries (-inf - -inf = nan among them) are zeroed before exp
    gap = (z_bound[:, :, None, 1:] - z_bound[:, :, :, None]).masked_fill(dead, 0.0)
    weights = gap.exp().masked_fill(dead, 0.0)
    states = torch.matmul(weights.permute(0, 1, 4, 2, 3), contrib.transpose(2, 3)).transpose(2, 3)  # (B,H,n+1,L,D)
    init_dead = ~(known[:, :, :1] & known)  # (B,H,n+1,L)
    init_weight = (z_bound[:, :, :1] - z_bound).masked_fill(init_dead, 0.0).exp().masked_fill(init_dead, 0.0)
    init_weight[:, :, 0] = 1.0  # boundary 0 is m_init, whatever its z
    states = states + init_weight.unsqueeze(-1) * m_init.unsqueeze(2)
    return states[:, :, :n], states[:, :, n]


def _exact_chunks(
    q: torch.Tensor, a: torch.Tensor, v: torch.Tensor, z_start: torch.Tensor, m_start: torch.Tensor
) -> torch.Tensor:
    """Output of whole chunks in log space (the fallback for extreme logit growth).

    q, a ``(N, C, L)``, v ``(N, C, D)``, z_start ``(N, L)``, m_start ``(N, L, D)`` (normalised at
    z_start). Every exponent is a_s - z_t or z_start - z_t with s <= t, hence <= 0.
    """
    z = torch.logaddexp(z_start.unsqueeze(1), torch.logcumsumexp(a, dim=1))
    z_safe = finite_or_zero(z)
    w = _IntraChunkWeights.apply(q, a, z_safe)
    q_inter = q * torch.exp(z_start.unsqueeze(1) - z_safe)
    return torch.baddbmm(torch.bmm(q_inter, m_start), w, v)


def _redo_extreme_chunks(
    out: torch.Tensor, share: torch.Tensor, q: torch.Tensor, a: torch.Tensor, v: torch.Tensor,
    z_start: torch.Tensor, m_start: torch.Tensor,
) -> torch.Tensor:
    """Recompute in log space the chunks whose normaliser grows by more than FACTORISED_MAX_RANGE.

    ``out`` ``(B H n, C, D)``; ``share`` ``(B,H,n,C,L)`` = exp(z_t - z_end). A share below
    exp(-40) at a position that has seen a key marks its chunk; a zero share before any key
    (padding) does not.
    """
    B, H, n, C, L = share.shape
    tiny = share < _MIN_SHARE
    if not bool(tiny.any()):
        return out
    seen = (torch.cumsum(torch.isfinite(a), dim=3) > 0) | torch.isfinite(z_start).unsqueeze(3)
    extreme = (tiny & seen).flatten(3).any(dim=-1).reshape(-1)  # (B H n,)
    if not bool(extreme.any()):
        return out
    idx = extreme.nonzero().squeeze(-1)
    pick = lambda x: x.reshape(B * H * n, *x.shape[3:]).index_select(0, idx)  # noqa: E731
    exact = _exact_chunks(pick(q), pick(a), pick(v), pick(z_start), pick(m_start))
    return out.index_copy(0, idx, exact)


def causal_latte_chunked(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int = 64,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LatteState | None]:
    """Chunkwise-parallel causal Latte: O(T C (L + D) + T L D) time, linear memory in T.

    Everything in a chunk is taken against its end log-normaliser r = z_end: keys enter as
    exp(a_s - r) <= 1, and the running normaliser as exp(z_t - r) = exp(z_start - r) + a cumsum
    of those key factors, so no per-token log is taken. The token-to-token weights of a chunk
    are then one (C, L) @ (L, C) GEMM, and its chunk-start state (a scan over T / C chunks)
    enters through a second GEMM. A chunk whose normaliser grows by more than
    ``FACTORISED_MAX_RANGE`` nats is recomputed in log space.

    Args:
        q_weights: ``(B, H, T, L)`` non-negative mixing weights p(l|t) over the latents.
        k_logits: ``(B, H, T, L)`` latent key logits a_{t,l}.
        v: ``(B, H, T, D)`` values.
        chunk_size: tokens per chunk ``C``.
        key_padding_mask: ``(B, T)`` bool, True for real tokens; padded positions output 0 and
            leave the state alone.
        initial_state: the :class:`LatteState` to continue from (None: empty).
        output_final_state: also return the state after the last token.

    Returns:
        ``(out, state)``: ``out`` ``(B, H, T, D)`` in ``v.dtype``; the final :class:`LatteState`
        (m ``(B, H, L, D)``, z ``(B, H, L)``) if requested, else None.

    Example:
        >>> import torch
        >>> from retrofit.ops import causal_latte_chunked
        >>> q = torch.softmax(torch.randn(1, 2, 10, 4), dim=-1)
        >>> out, state = causal_latte_chunked(q, torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 8),
        ...                                   chunk_size=4, output_final_state=True)
        >>> out.shape, state.m.shape, state.z.shape
        (torch.Size([1, 2, 10, 8]), torch.Size([1, 2, 4, 8]), torch.Size([1, 2, 4]))
    """
    B, H, T, L = k_logits.shape
    D = v.shape[-1]
    dtype = compute_dtype(q_weights, k_logits, v)
    C = max(1, min(chunk_size, T))
    span = C * max(1, NO_GRAD_STATE_BYTES // (2 * B * H * L * D * torch.finfo(dtype).bits // 8))
    if T > span and not _tracked(q_weights, k_logits, v, initial_state):
        return _segmented(q_weights, k_logits, v, span, chunk_size, key_padding_mask, initial_state, output_final_state)
    if T == 0:
        state = initial_state if initial_state is not None else LatteState.empty(B, H, L, D, device=v.device, dtype=dtype)
        return v.new_zeros(B, H, 0, D), (state if output_final_state else None)
    n = -(-T // C)
    pad = n * C - T
    a = masked_logits(k_logits, key_padding_mask, dtype)
    q = q_weights.to(dtype)
    vv = v.to(dtype)
    if pad:
        a = torch.nn.functional.pad(a, (0, 0, 0, pad), value=NEG_INF)
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        vv = torch.nn.functional.pad(vv, (0, 0, 0, pad))
    a = a.view(B, H, n, C, L)
    q = q.view(B, H, n, C, L)
    vv = vv.view(B, H, n, C, D)

    if initial_state is None:
        z_init = a.new_full((B, H, 1, L), NEG_INF)
        m_init = a.new_zeros(B, H, L, D)
    else:
        z_init = initial_state.z.to(dtype).unsqueeze(2)
        m_init = initial_state.m.to(dtype)

    # chunk-end log-normalisers r = z_end: every exponent below is taken against them (<= 0)
    chunk_total = torch.logsumexp(a, dim=3)  # (B,H,n,L)
    z_bound = torch.logcumsumexp(torch.cat([z_init, chunk_total], dim=2), dim=2)  # (B,H,n+1,L)
    z_start, z_end = z_bound[:, :, :-1], z_bound[:, :, 1:]
    r = finite_or_zero(z_end)
    k_f = torch.exp(a - r.unsqueeze(3))  # key factor exp(a_s - r) <= 1
    carry = torch.exp(z_start - r)  # weight of the tokens before the chunk, exp(z_start - r) <= 1
    # exp(z_t - r) = carry + sum_{s<=t in chunk} exp(a_s - r): the running normaliser without a log
    share = torch.cumsum(k_f, dim=3).add_(carry.unsqueeze(3))
    q_f = q / share.clamp(min=_MIN_SHARE)  # q exp(r - z_t)

    # intra-chunk token-to-token weights q_t exp(a_s - z_t): one (C, L) @ (L, C) GEMM per chunk
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    w_intra = torch.matmul(q_f, k_f.transpose(-1, -2)).masked_fill_(~causal, 0.0)  # matmul saves only its inputs

    # chunk-start states (normalised at z_start) by a scan over chunks
    contrib = torch.matmul(k_f.transpose(-1, -2), vv)  # (B,H,n,L,D), normalised at r
    m_start, m = _scan_chunk_states(contrib, carry, m_init, z_bound)

    # out = q exp(z_start - z_t) m_start + W V, the second GEMM accumulating in place (bmm's
    # backward needs only its inputs, so this is autograd-safe and saves a (T, D) copy)
    q_inter = q_f * carry.unsqueeze(3)
    out = torch.bmm(q_inter.reshape(-1, C, L), m_start.reshape(-1, L, D))
    out = out.baddbmm_(w_intra.reshape(-1, C, C), vv.reshape(-1, C, D))
    out = _redo_extreme_chunks(out, share, q, a, vv, z_start, m_start)

    out = out.view(B, H, n * C, D)[:, :, :T]
    if key_padding_mask is not None:
        out = out * key_padding_mask.bool()[:, None, :, None]
    final = LatteState(m=m, z=z_end[:, :, -1]) if output_final_state else None
    return out.to(v.dtype), final


def _tracked(*xs: torch.Tensor | LatteState | None) -> bool:
    """Whether autograd records ops on any of the inputs (a state counts by its tensors)."""
    if not torch.is_grad_enabled():
        return False
    flat = [t for x in xs if x is not None for t in ((x.m, x.z) if isinstance(x, LatteState) else (x,))]
    return any(t.requires_grad for t in flat)


def _segmented(
    q_weights: torch.Tensor, k_logits: torch.Tensor, v: torch.Tensor, span: int, chunk_size: int,
    key_padding_mask: torch.Tensor | None, initial_state: LatteState | None, output_final_state: bool,
) -> tuple[torch.Tensor, LatteState | None]:
    """``causal_latte_chunked`` over segments of ``span`` tokens (a multiple of the chunk), each
    starting from the state the one before ended with: the chunked form holds every chunk-start
    state, (B, H, T / C, L, D) twice, which at 32K tokens is 512 MiB per layer for 4 heads of
    L = 128, D = 256. Without autograd nothing needs them after their segment."""
    B, H, T, _ = k_logits.shape
    out = v.new_empty(B, H, T, v.shape[-1])
    state = initial_state
    for s in range(0, T, span):
        e = min(T, s + span)
        mask = None if key_padding_mask is None else key_padding_mask[:, s:e]
        out[:, :, s:e], state = causal_latte_chunked(
            q_weights[:, :, s:e], k_logits[:, :, s:e], v[:, :, s:e], chunk_size=chunk_size,
            key_padding_mask=mask, initial_state=state, output_final_state=True,
        )
    return out, (state if output_final_state else None)


# --------------------------------------------------------------------------------------
# recurrent


def causal_latte_step(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    state: LatteState,
    *,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LatteState]:
    """One decoding token of causal Latte: O(L D) per head.

    Args:
        q_weights: ``(B, H, L)`` mixing weights of the new token.
        k_logits: ``(B, H, L)`` its latent key logits.
        v: ``(B, H, D)`` its value.
        state: the :class:`LatteState` before the token.
        valid: ``(B,)`` bool; rows marked False (padding) leave the state untouched and output 0.

    Returns:
        ``(out, state)``: ``out`` ``(B, H, D)`` in ``v.dtype``; the state after the token.

    Example:
        >>> import torch
        >>> from retrofit.ops import LatteState, causal_latte_step
        >>> state = LatteState.empty(1, 2, 4, 8)
        >>> q = torch.softmax(torch.randn(1, 2, 4), dim=-1)
        >>> out, state = causal_latte_step(q, torch.randn(1, 2, 4), torch.randn(1, 2, 8), state)
        >>> out.shape
        torch.Size([1, 2, 8])
    """
    dtype = compute_dtype(q_weights, k_logits, v, state.m)
    a = masked_logits(k_logits, valid, dtype)
    z_old = state.z.to(dtype)
    z_new = torch.logaddexp(z_old, a)
    z_new_safe = finite_or_zero(z_new)
    decay, weight = torch.exp(z_old - z_new_safe).unsqueeze(-1), torch.exp(a - z_new_safe).unsqueeze(-1)
    m = torch.addcmul(decay * state.m.to(dtype), weight, v.to(dtype).unsqueeze(2))
    out = torch.matmul(q_weights.to(dtype).unsqueeze(2), m).squeeze(2)  # (B, H, 1, L) @ (B, H, L, D)
    if valid is not None:
        out = out * valid.bool()[:, None, None]
    return out.to(v.dtype), LatteState(m=m, z=z_new)


def causal_latte_recurrent(
    q_weights: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LatteState | None = None,
) -> tuple[torch.Tensor, LatteState]:
    """Token-by-token loop over :func:`causal_latte_step` (decoding path; also a second reference).

    Args:
        q_weights: ``(B, H, T, L)`` mixing weights.
        k_logits: ``(B, H, T, L)`` latent key logits.
        v: ``(B, H, T, D)`` values.
        key_padding_mask: ``(B, T)`` bool, True for real tokens.
        initial_state: the :class:`LatteState` to continue from (None: empty).

    Returns:
        ``(out, state)``: ``out`` ``(B, H, T, D)`` in ``v.dtype``; the final :class:`LatteState`.

    Example:
        >>> import torch
        >>> from retrofit.ops import causal_latte_recurrent
        >>> q = torch.softmax(torch.randn(1, 2, 5, 4), dim=-1)
        >>> out, state = causal_latte_recurrent(q, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 8))
        >>> out.shape, state.m.shape
        (torch.Size([1, 2, 5, 8]), torch.Size([1, 2, 4, 8]))
    """
    B, H, T, L = k_logits.shape
    D = v.shape[-1]
    state = initial_state or LatteState.empty(B, H, L, D, device=v.device, dtype=compute_dtype(q_weights, k_logits, v))
    outs = []
    for t in range(T):
        valid = None if key_padding_mask is None else key_padding_mask[:, t]
        o, state = causal_latte_step(q_weights[:, :, t], k_logits[:, :, t], v[:, :, t], state, valid=valid)
        outs.append(o)
    return torch.stack(outs, dim=2), state


def causal_latte(
    q_logits: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int = 64,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain causal Latte (Definition 2) from query logits: p(l|t) = softmax_l(q_logits).

    Args:
        q_logits: ``(B, H, T, L)`` latent query logits.
        k_logits: ``(B, H, T, L)`` latent key logits.
        v: ``(B, H, T, D)`` values.
        chunk_size: tokens per chunk of :func:`causal_latte_chunked`.
        key_padding_mask: ``(B, T)`` bool, True for real tokens.

    Returns:
        ``(B, H, T, D)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import causal_latte
        >>> causal_latte(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 8)).shape
        torch.Size([1, 2, 10, 8])
    """
    p = torch.softmax(q_logits.to(compute_dtype(q_logits)), dim=-1)
    out, _ = causal_latte_chunked(p, k_logits, v, chunk_size=chunk_size, key_padding_mask=key_padding_mask)
    return out


# --------------------------------------------------------------------------------------
# bidirectional (encoder) Latte, Definition 1


def bidirectional_latte(
    q_logits: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional (encoder) Latte, Definition 1: softmax_L(Q) softmax_T(K)^T V in O(T L D).

    Args:
        q_logits: ``(B, H, T, L)`` latent query logits (softmax over L).
        k_logits: ``(B, H, T, L)`` latent key logits (softmax over the T real tokens).
        v: ``(B, H, T, D)`` values.
        key_padding_mask: ``(B, T)`` bool, True for real tokens; padded queries output 0.

    Returns:
        ``(B, H, T, D)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import bidirectional_latte
        >>> mask = torch.tensor([[False, True, True, True, True, True]])
        >>> out = bidirectional_latte(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 8),
        ...                           key_padding_mask=mask)
        >>> out.shape, bool(out[:, :, 0].eq(0).all())
        (torch.Size([1, 2, 6, 8]), True)
    """
    dtype = compute_dtype(q_logits, k_logits, v)
    a = masked_logits(k_logits, key_padding_mask, dtype)
    p_l = torch.softmax(q_logits.to(dtype), dim=-1)  # (B,H,T,L)
    p_s = torch.softmax(a, dim=-2).nan_to_num(0.0)  # over T
    summary = torch.matmul(p_s.transpose(-1, -2), v.to(dtype))  # (B,H,L,D)
    out = torch.matmul(p_l, summary)
    if key_padding_mask is not None:
        out = out * key_padding_mask.bool()[:, None, :, None]
    return out.to(v.dtype)


def bidirectional_latte_reference(
    q_logits: torch.Tensor,
    k_logits: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The T x T attention matrix sum_l p(l|t) p(s|l), materialised (tests only).

    Args:
        q_logits: ``(B, H, T, L)`` latent query logits.
        k_logits: ``(B, H, T, L)`` latent key logits.
        v: ``(B, H, T, D)`` values.
        key_padding_mask: ``(B, T)`` bool, True for real tokens.

    Returns:
        ``(B, H, T, D)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import bidirectional_latte_reference
        >>> q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 8)
        >>> bidirectional_latte_reference(q, k, v).shape
        torch.Size([1, 2, 6, 8])
    """
    dtype = compute_dtype(q_logits, k_logits, v)
    a = masked_logits(k_logits, key_padding_mask, dtype)
    p_l = torch.softmax(q_logits.to(dtype), dim=-1)
    p_s = torch.softmax(a, dim=-2).nan_to_num(0.0)
    attn = torch.einsum("bhtl,bhsl->bhts", p_l, p_s)
    out = torch.matmul(attn, v.to(dtype))
    if key_padding_mask is not None:
        out = out * key_padding_mask.bool()[:, None, :, None]
    return out.to(v.dtype)
