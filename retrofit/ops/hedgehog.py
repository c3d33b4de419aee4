"""Hedgehog linear attention over the keys that have left a sliding window.

The read beside a ``w``-token window in LoLCATs-style conversions: each query head keeps a
linear-attention state of every key older than its window, in learned spiky feature maps
(Hedgehog, Zhang et al. 2024)

    phi(x) = [softmax(W x), softmax(-W x)]          W (f, d) per head: 2 f features, each half sums to 1

so that ``phi_q(q) . phi_k(k)`` can imitate ``exp(q . k / sqrt(d))`` once fitted. For query t
(stream position t) this module returns the unnormalised read and its normaliser

    num_t  = sum_{s <= t - w, write_s} (phi_q(q_t) . phi_k(k_s)) v_s      (D,)
    mass_t = sum_{s <= t - w, write_s}  phi_q(q_t) . phi_k(k_s)           scalar

and the layer mixes ``num_t / mass_t`` with the window by their masses (see
:mod:`retrofit.layers.hedgehog`). Keys not written (padding, attention sinks the window keeps)
are skipped. The state after a call, :class:`HedgehogState` ``S = sum phi_k(k_s) v_s^T`` ``(B, H,
F, D)`` and ``z = sum phi_k(k_s)`` ``(B, H, F)``, holds every written key that no later query's
window contains: stream positions ``s <= t_last - w + 1``.

Inputs follow the window kernels' layout: ``fq`` ``(B, H, T, F)`` features of the T new queries,
``fk`` ``(B, H, P + T, F)`` and ``v`` ``(B, H, P + T, D)`` of ``P = num_past`` cached keys (at most
``w - 1``, the ones the window still holds, so none of them is in the state yet) then the T new
ones, ``write`` ``(B, P + T)`` bool. Query ``i`` sits at stream position ``t0 + i`` and key ``j``
at ``t0 - P + j``, so query i reads the keys ``j <= i + P - w``.

Two forms, tested against each other: :func:`hedgehog_read_reference` (dense scores, the
definition) and :func:`hedgehog_read_chunked` (the visible keys shifted onto their first reader,
then causal linear attention in chunks of C tokens: O(T (C F + F D))). Both are differentiable.
Decoding takes :func:`hedgehog_read_step`: one query reads the state, then the state takes the one
key that leaves the window behind it (``O(F D)`` per token and head).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["HedgehogState", "hedgehog_features", "hedgehog_read_chunked", "hedgehog_read_reference",
           "hedgehog_read_step"]

DEFAULT_HEDGEHOG_CHUNK = 64


@dataclass
class HedgehogState:
    """The memory of the keys beyond the window: ``S`` ``(B, H, F, D)`` and ``z`` ``(B, H, F)``, fp32 at least."""

    S: torch.Tensor
    z: torch.Tensor


def _up(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 at least (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, 2 f)`` features (fp32 at least) ``[softmax(W_h x), softmax(-W_h x)]`` of ``x (B, H, T, d)``
    through ``weight (H, f, d)`` (one map per head).

    Example:
        >>> import torch
        >>> from retrofit.ops.hedgehog import hedgehog_features
        >>> phi = hedgehog_features(torch.randn(1, 2, 5, 8), torch.randn(2, 16, 8))
        >>> phi.shape, phi.sum(-1).allclose(torch.full((1, 2, 5), 2.0))
        (torch.Size([1, 2, 5, 32]), True)
    """
    x = _up(x)
    z = x @ weight.to(x.dtype).transpose(-1, -2)  # (B, H, T, d) @ (H, d, f): one batched product
    return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1)


def _check(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, write: torch.Tensor, window: int, num_past: int) -> None:
    T, Tk = fq.shape[2], fk.shape[2]
    if Tk != num_past + T or v.shape[2] != Tk or write.shape[-1] != Tk:
        raise ValueError(f"keys, values and write ({Tk}, {v.shape[2]}, {write.shape[-1]}) must be num_past ({num_past}) "
                         f"+ queries ({T})")
    if window < 1 or num_past > window - 1:
        raise ValueError(f"num_past ({num_past}) must be at most window - 1 ({window - 1}): older keys are in the state")


def _initial(state: HedgehogState | None, fq: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, _, Fe = fq.shape
    if state is None:
        return _up(fq).new_zeros(B, H, Fe, D), _up(fq).new_zeros(B, H, Fe)
    return _up(state.S), _up(state.z)


def _written(fk: torch.Tensor, v: torch.Tensor, write: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with the unwritten ones zeroed (so nothing non-finite there reaches a sum)."""
    keep = write[:, None, :, None].to(fk.device)
    return _up(fk).masked_fill(~keep, 0.0), _up(v).to(_up(fk).dtype).masked_fill(~keep, 0.0)


def _final_state(S: torch.Tensor, z: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, upto: int) -> HedgehogState:
    """``(S, z)`` plus the keys ``j < upto`` of the (already masked) ``fk``, ``v``."""
    if upto > 0:
        S = S + fk[:, :, :upto].transpose(-1, -2) @ v[:, :, :upto]
        z = z + fk[:, :, :upto].sum(2)
    return HedgehogState(S, z)


def hedgehog_read_reference(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    write: torch.Tensor,
    *,
    window: int,
    num_past: int = 0,
    initial_state: HedgehogState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, HedgehogState | None]:
    """The read beyond the window from dense ``(T, P + T)`` scores (the definition).

    Args:
        fq: ``(B, H, T, F)`` query features.
        fk: ``(B, H, P + T, F)`` key features, ``P = num_past`` cached keys first.
        v: ``(B, H, P + T, D)`` values.
        write: ``(B, P + T)`` bool, the keys the memory stores.
        window: ``w``: query t reads the keys ``s <= t - w``.
        num_past: ``P <= w - 1``.
        initial_state: the keys before the call (None: empty).
        output_final_state: also return the state after the call.

    Returns:
        ``(num (B, H, T, D), mass (B, H, T), HedgehogState or None)``, fp32 at least.
    """
    _check(fq, fk, v, write, window, num_past)
    T, Tk = fq.shape[2], fk.shape[2]
    S0, z0 = _initial(initial_state, fq, v.shape[-1])
    fk, v = _written(fk, v, write)
    i, j = torch.arange(T, device=fq.device)[:, None], torch.arange(Tk, device=fq.device)[None, :]
    scores = (_up(fq) @ fk.transpose(-1, -2)) * (j <= i + num_past - window)
    num = scores @ v + _up(fq) @ S0
    mass = scores.sum(-1) + (_up(fq) * z0[:, :, None]).sum(-1)
    state = _final_state(S0, z0, fk, v, T + num_past - window + 1) if output_final_state else None
    return num, mass, state


def hedgehog_read_chunked(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    write: torch.Tensor,
    *,
    window: int,
    num_past: int = 0,
    initial_state: HedgehogState | None = None,
    output_final_state: bool = False,
    chunk_size: int = DEFAULT_HEDGEHOG_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, HedgehogState | None]:
    """The read beyond the window in chunks: same arguments and results as :func:`hedgehog_read_reference`.

    Key ``j`` first becomes visible to query ``j + s`` (``s = w - P >= 1``), so the keys shifted
    by ``s`` onto the query positions make the read an inclusive causal linear attention: per
    chunk ``Q S`` (the state entering it) plus ``(Q K^T, j <= i) V``, and the state runs chunk to
    chunk. The final state adds the one key that becomes unreachable after the call without a
    reader in it (``j = T - s``).

    Args:
        fq: ``(B, H, T, F)`` query features.
        fk: ``(B, H, P + T, F)`` key features, ``P = num_past`` cached keys first.
        v: ``(B, H, P + T, D)`` values.
        write: ``(B, P + T)`` bool, the keys the memory stores.
        window: ``w``: query t reads the keys ``s <= t - w``.
        num_past: ``P <= w - 1``.
        initial_state: the keys before the call (None: empty).
        output_final_state: also return the state after the call.
        chunk_size: ``C``, queries per chunk.

    Returns:
        ``(num (B, H, T, D), mass (B, H, T), HedgehogState or None)``, fp32 at least.

    Example:
        >>> import torch
        >>> from retrofit.ops.hedgehog import hedgehog_read_chunked, hedgehog_read_reference
        >>> fq, fk = torch.rand(1, 2, 40, 6), torch.rand(1, 2, 40, 6)
        >>> v, write = torch.randn(1, 2, 40, 4), torch.ones(1, 40, dtype=torch.bool)
        >>> a = hedgehog_read_chunked(fq, fk, v, write, window=8, chunk_size=16)
        >>> b = hedgehog_read_reference(fq, fk, v, write, window=8)
        >>> torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)
        True
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check(fq, fk, v, write, window, num_past)
    B, H, T, Fe = fq.shape
    D = v.shape[-1]
    S, z = _initial(initial_state, fq, D)
    fk, v = _written(fk, v, write)
    shift = window - num_past
    C = min(chunk_size, max(T, 1))
    # with an empty memory the chunks before the first shifted key read nothing: they are skipped
    first = max(min(shift, T - 1), 0) // C * C if initial_state is None else 0  # at least one chunk stays
    # key i - s at query i, from query ``first`` on: (B, H, T - first, F)
    lead = min(shift, T) - first
    ks = F.pad(fk[:, :, : max(T - shift, 0)], (0, 0, lead, 0))
    vs = F.pad(v[:, :, : max(T - shift, 0)], (0, 0, lead, 0))
    q = _up(fq)[:, :, first:]
    N = -(-(T - first) // C)
    pad = N * C - (T - first)
    if pad:
        q, ks, vs = (F.pad(x, (0, 0, 0, pad)) for x in (q, ks, vs))
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    nums, masses = [], []
    for q_n, k_n, v_n in zip(q.view(B, H, N, C, Fe).unbind(2), ks.view(B, H, N, C, Fe).unbind(2),
                             vs.view(B, H, N, C, D).unbind(2)):
        a = (q_n @ k_n.transpose(-1, -2)) * lower
        nums.append(q_n @ S + a @ v_n)
        masses.append(q_n @ z[..., None] + a.sum(-1, keepdim=True))
        S = S + k_n.transpose(-1, -2) @ v_n
        z = z + k_n.sum(2)
    num = torch.stack(nums, 2).reshape(B, H, N * C, D)[:, :, : T - first]
    mass = torch.stack(masses, 2).reshape(B, H, N * C)[:, :, : T - first]
    if first:
        num, mass = F.pad(num, (0, 0, first, 0)), F.pad(mass, (first, 0))
    state = None
    if output_final_state:  # the chunks stored keys j < T - s; add j = T - s if it exists
        last = T - shift
        if 0 <= last:
            S = S + fk[:, :, last, :, None] * v[:, :, last, None, :]
            z = z + fk[:, :, last]
        state = HedgehogState(S, z)
    return num, mass, state


def hedgehog_read_step(
    fq: torch.Tensor,
    fk_leaving: torch.Tensor,
    v_leaving: torch.Tensor,
    write_leaving: torch.Tensor,
    state: HedgehogState | None,
) -> tuple[torch.Tensor, torch.Tensor, HedgehogState]:
    """One decoding token: query ``t`` reads ``state`` (the keys ``s <= t - w``), then the state takes
    key ``t - w + 1``, the oldest of the query's window, which no later window holds.

    The same function as :func:`hedgehog_read_reference` on one query with ``num_past = w - 1``
    cached keys (the test runs a sequence through both).

    Args:
        fq: ``(B, H, 1, F)`` the query's features.
        fk_leaving: ``(B, H, 1, F)`` features of key ``t - w + 1``.
        v_leaving: ``(B, H, 1, D)`` its value.
        write_leaving: ``(B, 1)`` bool: whether the memory stores it (False: no such key yet,
            padding, a sink).
        state: the memory before the token (None: empty).

    Returns:
        ``(num (B, H, 1, D), mass (B, H, 1), state)``, fp32 at least.

    Example:
        >>> import torch
        >>> from retrofit.ops.hedgehog import hedgehog_read_step
        >>> fq, fk, v = torch.rand(1, 2, 1, 6), torch.rand(1, 2, 1, 6), torch.randn(1, 2, 1, 4)
        >>> num, mass, state = hedgehog_read_step(fq, fk, v, torch.ones(1, 1, dtype=torch.bool), None)
        >>> float(mass.abs().sum()), state.S.shape
        (0.0, torch.Size([1, 2, 6, 4]))
    """
    S, z = _initial(state, fq, v_leaving.shape[-1])
    q = _up(fq)
    num = q @ S
    mass = (q * z[:, :, None]).sum(-1)
    fk, v = _written(fk_leaving, v_leaving, write_leaving)
    # the outer product phi_k(k) v^T added in one broadcast op: (B, H, F, 1) * (B, H, 1, D)
    return num, mass, HedgehogState(torch.addcmul(S, fk.transpose(-1, -2), v), z + fk[:, :, 0])
