"""LLP (Long-LoRA-inspired PerceiverAR) attention: overlapping half-segment block attention, O(T * s).

Tokens are grouped into half-segments of ``h = s / 2`` tokens (``s`` = ``segment``). A query in
half-segment ``i`` attends to every key of half-segment ``i - 1`` and causally to the keys of
its own half-segment ``i``; the first half-segment sees only itself (the paper's "ATTN" block,
eqs. 22-25; the others are its "PAR" blocks, eqs. 26-29). With ``rank`` the position of a
token among the real (non-padding) tokens of its row:

    query at rank t may see key at rank u  <=>  u <= t  and  floor(u / h) >= floor(t / h) - 1

Half-segments are counted over real tokens, so a left-padded row of a batch gives the same
result as the same row alone (padding never shifts the segment grid). Positional encodings
(RoPE) are the caller's business: q and k arrive already rotated.

Shapes: q ``(B, Hq, Tq, d)``, k ``(B, Hkv, Tk, d)``, v ``(B, Hkv, Tk, Dv)`` with ``Hq % Hkv == 0``
(grouped-query attention). ``key_padding_mask`` ``(B, T)`` is True for real tokens; queries
at padded positions return zeros. Scores are ``scaling * q.k`` (default ``d ** -0.5``),
optionally soft-capped ``c * tanh(score / c)`` before masking (Gemma 2).

Forms:
- :func:`llp_attention_reference`: dense masked O(T^2) (tests, and short query blocks);
- :func:`llp_attention`: blocked SDPA, O(T * s) time and memory, queries of one half-segment
  against the keys of two;
- :func:`llp_attention_cached` with :class:`LLPState`: decoding / chunked prefill. The state
  keeps only what a future query can see: the keys/values of the previous and the current
  half-segment (at most ``s`` real tokens per row), so memory is constant in context length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retrofit.ops._common import (
    block_attention, from_blocks, grouped_attend, grouped_scores, query_blocks, real_tokens, two_blocks,
)

__all__ = ["LLPState", "llp_attention", "llp_attention_cached", "llp_attention_reference"]


def _half(segment: int) -> int:
    if segment < 2 or segment % 2:
        raise ValueError(f"LLP segment must be an even integer >= 2 (it is split in two halves), got {segment}")
    return segment // 2


def _ranks(valid: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
    """``(B, T)`` bool -> ``(B, T)`` long rank among real tokens (+ offset); -1 at padding."""
    offset = offset[:, None] if isinstance(offset, torch.Tensor) else offset
    r = torch.cumsum(valid.long(), dim=1) - 1 + offset
    return r.masked_fill(~valid, -1)


def _rank_masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_rank: torch.Tensor,
    k_rank: torch.Tensor,
    half: int,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """Dense LLP attention from explicit ranks: q_rank ``(B, Tq)``, k_rank ``(B, Tk)`` (-1 = padding).

    Returns ``(B, Hq, Tq, Dv)``; rows whose query is padding (rank -1) are zero.
    """
    B, Tq, Tk = q.shape[0], q.shape[2], k.shape[2]
    scores = grouped_scores(q, k, scaling, softcap)
    qr, kr = q_rank[:, :, None], k_rank[:, None, :]  # (B, Tq, 1), (B, 1, Tk)
    q_valid = qr >= 0
    allowed = (kr >= 0) & (kr <= qr) & (torch.div(kr, half, rounding_mode="floor") >= torch.div(qr, half, rounding_mode="floor") - 1)
    # a padded query gets one harmless key so that its softmax row is finite; zeroed below
    first_key = torch.zeros(Tk, dtype=torch.bool, device=q.device)
    first_key[0] = True
    allowed = allowed | (~q_valid & first_key)
    out = grouped_attend(scores.masked_fill(~allowed[:, None, None], float("-inf")), v)
    return out * q_valid.view(B, 1, Tq, 1).to(out.dtype)


def llp_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense masked form, O(T^2): the reference.

    Args:
        q, k, v, segment, scaling, softcap, key_padding_mask: as :func:`llp_attention`.

    Returns:
        ``(B, Hq, T, Dv)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import llp_attention_reference
        >>> q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
        >>> llp_attention_reference(q, k, v, 4).shape
        torch.Size([1, 4, 12, 8])
    """
    B, _, T, d = q.shape
    if k.shape[2] != T:
        raise ValueError(f"llp_attention_reference needs as many keys as queries ({k.shape[2]} != {T})")
    valid = real_tokens(key_padding_mask, B, T, q.device)
    rank = _ranks(valid)
    return _rank_masked_attention(q, k, v, rank, rank, _half(segment), d**-0.5 if scaling is None else scaling, softcap)


def _compact(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row permutation that moves real tokens to the front in order: ``(order, inverse)``, ``(B, T)``."""
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return order, torch.argsort(order, dim=1)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather along the time axis: x ``(B, H, T, c)``, index ``(B, T)``."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))


def llp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment: int,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocked LLP attention: O(T * s * d) time and O(T * s) memory.

    Queries of half-segment ``i`` attend to keys of half-segments ``i - 1`` and ``i`` (causal
    within ``i``) through one SDPA call over ``(T / h)`` blocks of ``h`` queries x ``2h`` keys
    (plain matmul + softmax when soft-capping, which SDPA cannot express). With a padding
    mask, each row's real tokens are first gathered to the front (a stable per-row
    permutation) so that half-segments are counted over real tokens, and scattered back.

    Args:
        q: ``(B, Hq, T, d)`` queries.
        k: ``(B, Hkv, T, d)`` keys (``Hq % Hkv == 0``; as many as queries: cached keys go
            through :func:`llp_attention_cached`).
        v: ``(B, Hkv, T, Dv)`` values.
        segment: ``s``, even: half-segments of ``s / 2`` real tokens.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, T)`` bool, True for real tokens; padded queries output 0.

    Returns:
        ``(B, Hq, T, Dv)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import llp_attention
        >>> q, k, v = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
        >>> llp_attention(q, k, v, 16).shape
        torch.Size([1, 4, 40, 8])
    """
    B, Hq, T, d = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    if k.shape[2] != T:
        raise ValueError(f"llp_attention needs as many keys as queries ({k.shape[2]} != {T}); use llp_attention_cached for cached keys")
    h = _half(segment)
    group = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    if T == 0:
        return v.new_zeros(B, Hq, 0, Dv)

    valid = None if key_padding_mask is None else key_padding_mask.bool()
    if valid is not None and bool(valid.all()):
        valid = None
    inverse = None
    if valid is not None:
        order, inverse = _compact(valid)
        q, k, v = _take(q, order), _take(k, order), _take(v, order)
        valid = valid.gather(1, order)  # real tokens first, then padding

    n = -(-T // h)
    tail = n * h - T
    # block j of the padded keys (j = 0..n) holds half-segment j - 1
    kb, vb = (two_blocks(F.pad(x, (0, 0, h, tail)), h) for x in (k, v))  # (B, Hkv, n, 2h, .)
    kvalid = torch.ones(B, T, dtype=torch.bool, device=q.device) if valid is None else valid
    kvalid = F.pad(kvalid, (h, tail), value=False)  # (B, (n + 1) h)
    kmask = two_blocks(kvalid.unsqueeze(-1), h).squeeze(-1)  # (B, n, 2h)
    qb = query_blocks(q, Hkv, h, tail)

    a = torch.arange(h, device=q.device)
    band = torch.cat([torch.ones(h, h, dtype=torch.bool, device=q.device), a[None, :] <= a[:, None]], dim=1)  # (h, 2h)
    self_key = torch.cat([torch.zeros(h, h, dtype=torch.bool, device=q.device), torch.eye(h, dtype=torch.bool, device=q.device)], dim=1)
    q_valid = kvalid[:, h:].view(B, n, h)
    # padded queries (and the tail) see their own slot only, so no softmax row is all -inf
    allowed = (band & kmask[:, :, None, :]) | (~q_valid[..., None] & self_key)  # (B, n, h, 2h)
    allowed = allowed.unsqueeze(2).expand(B, n, group, h, 2 * h).reshape(B, 1, n, group * h, 2 * h)

    out = from_blocks(block_attention(qb, kb, vb, allowed, scaling, softcap), group)[:, :, :T]
    if inverse is not None:
        out = out * q_valid.reshape(B, 1, n * h, 1)[:, :, :T].to(out.dtype)
        out = _take(out, inverse)
    return out


@dataclass
class LLPState:
    """What LLP decoding must keep for one layer: the keys/values a future query can still see.

    k: ``(B, Hkv, L, d)``, v: ``(B, Hkv, L, Dv)`` cached (already position-encoded) keys/values;
    rank: ``(B, L)`` long, each slot's rank among its row's real tokens, -1 for padding;
    seen: ``(B,)`` long, real tokens consumed so far (the rank of the next real token).

    Slots are column-aligned across the batch (slot j holds the j-th fed token of every row).
    After each update only the slots that the next query of some row may see are kept: ranks
    ``>= h * (floor(seen / h) - 1)``, i.e. the previous and the current half-segment. ``L`` is
    at most ``s`` plus the padding the rows fed differently, whatever the context length.
    """

    k: torch.Tensor
    v: torch.Tensor
    rank: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, value_dim: int | None = None, *, device=None, dtype=torch.float32) -> "LLPState":
        value_dim = head_dim if value_dim is None else value_dim
        return cls(
            k=torch.zeros(batch, kv_heads, 0, head_dim, device=device, dtype=dtype),
            v=torch.zeros(batch, kv_heads, 0, value_dim, device=device, dtype=dtype),
            rank=torch.zeros(batch, 0, dtype=torch.long, device=device),
            seen=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def index_select(self, batch_index: torch.Tensor) -> "LLPState":
        return LLPState(
            self.k.index_select(0, batch_index), self.v.index_select(0, batch_index),
            self.rank.index_select(0, batch_index), self.seen.index_select(0, batch_index),
        )

    def trimmed(self, half: int) -> "LLPState":
        """Drop the leading slots no row's next query can see."""
        start = half * (torch.div(self.seen, half, rounding_mode="floor") - 1)  # (B,)
        needed = (self.rank >= 0) & (self.rank >= start[:, None])
        keep = needed.any(dim=0)
        if not bool(keep.any()):
            first = self.length
        else:
            first = int(torch.nonzero(keep)[0, 0])
        if first == 0:
            return self
        return LLPState(self.k[:, :, first:], self.v[:, :, first:], self.rank[:, first:], self.seen)


def llp_attention_cached(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment: int,
    state: LLPState | None = None,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LLPState]:
    """LLP over new tokens that continue ``state`` (decoding and chunked prefill).

    Dense over ``(cached + new)`` keys, i.e. O(Tq * (s + Tq)); a long prefill from an empty state
    takes the blocked path. Prefill then token-by-token equals :func:`llp_attention` over the
    whole sequence.

    Args:
        q: ``(B, Hq, Tq, d)`` the new tokens' queries.
        k: ``(B, Hkv, Tq, d)`` the new tokens' keys (the cached ones are in ``state``).
        v: ``(B, Hkv, Tq, Dv)`` the new tokens' values.
        segment: ``s``, even: half-segments of ``s / 2`` real tokens.
        state: the :class:`LLPState` of the tokens before (None: empty).
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, Tq)`` bool, True for the real new tokens.

    Returns:
        ``(out, state)``: ``out`` ``(B, Hq, Tq, Dv)``; the new :class:`LLPState` (at most ``s``
        real tokens per row).

    Example:
        >>> import torch
        >>> from retrofit.ops import llp_attention_cached
        >>> q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
        >>> out, state = llp_attention_cached(q, k, v, 8)  # prefill
        >>> out, state = llp_attention_cached(q[:, :, :1], k[:, :, :1], v[:, :, :1], 8, state)  # one more token
        >>> out.shape, int(state.seen)
        (torch.Size([1, 4, 1, 8]), 21)
    """
    B, Hq, Tq, d = q.shape
    h = _half(segment)
    scaling = d**-0.5 if scaling is None else scaling
    if state is None:
        state = LLPState.empty(B, k.shape[1], d, v.shape[-1], device=q.device, dtype=k.dtype)
    valid = real_tokens(key_padding_mask, B, Tq, q.device)
    new_rank = _ranks(valid, state.seen)
    k_all = torch.cat([state.k.to(k.dtype), k], dim=2)
    v_all = torch.cat([state.v.to(v.dtype), v], dim=2)
    rank_all = torch.cat([state.rank, new_rank], dim=1)
    if state.length == 0 and Tq > segment and not bool(state.seen.any()):
        out = llp_attention(q, k, v, segment, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask)
    else:
        out = _rank_masked_attention(q, k_all, v_all, new_rank, rank_all, h, scaling, softcap)
    new_state = LLPState(k_all, v_all, rank_all, state.seen + valid.long().sum(dim=1)).trimmed(h)
    return out, new_state
