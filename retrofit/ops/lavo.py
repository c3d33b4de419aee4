"""LAVO: Linear Attention Via Orthogonal memory (paper sections 3.1-3.3), as pure tensor math.

Per head, with ``r`` orthogonal bases ``B = [b_1 .. b_r]`` ``(r, d)`` (orthogonal at init;
training may move them):

* **Orthogonal memory** (eqs. 3-4). The memory inputs x_s ``(d,)`` are projected on the bases,
  ``c_s = B x_s`` ``(r,)``, and averaged causally, ``H_t = mean_{s visible to t} c_s``. The
  memory rows are the scaled bases ``X~_t = B * H_t`` (row i is ``H_{t,i} b_i``: mutually
  orthogonal), read by a softmax over the ``r`` rows::

      global_t = softmax_i(scaling * q_t . X~_{t,i}) X~_t
               = sum_i p_{t,i} H_{t,i} b_i,   p_{t,i} = softmax_i(scaling * H_{t,i} (q_t . b_i))

  Cost O(T r d) in parallel (cumulative sums), O(r d) per decoded token; the state is the
  running sum of ``c_s`` and a token count (:class:`LavoState`), never the tokens.
  ``block=None`` is eq. 4 (token t sees s <= t). ``block=w`` is context dissection (sec. 3.2):
  tokens are cut into windows of ``w``; token t sees only the *complete* windows before its
  own, i.e. the first ``w * floor(rank_t / w)`` tokens. A token with nothing visible reads 0.
* **Local attention with a relative position bias** (secs. 3.2-3.3): causal sliding-window
  softmax attention over the last ``w`` tokens (t - w < s <= t, same convention as
  :mod:`retrofit.ops.sliding_window`) plus a learned bias by distance. The paper's
  ``P in R^{2w-1}`` adds ``P_{j-i+w-1}`` to score (i, j); under the causal mask only the ``w``
  entries with ``j <= i`` are reachable, so ``rel_bias[h, delta]`` (``(H, w)``) is stored by
  distance ``delta = i - j`` (paper ``P_{w-1-delta}``), added after scaling and soft-capping.
* **LAVO** (sec. 3.2): the local outputs are the memory inputs ("local attention on the tokens
  in each window before compressing the global context ... to reduce the variance"), the
  dissected memory is read with the queries, and the two are averaged. ``global_weight`` g
  generalises the average: ``out = (1 - g) local + g global`` (paper: g = 1/2); tokens whose
  memory is still empty (the first window) get ``out = local``.

Token positions for the window grid are ranks among a row's real tokens (``key_padding_mask``
True), so a left-padded batch row equals the same row alone. Shapes: q ``(B, Hq, T, d)``,
k ``(B, Hkv, Tk, d)``, v ``(B, Hkv, Tk, D)`` (GQA: ``Hq % Hkv == 0``), bases ``(Hq, r, D)``.
Internal math of the memory runs in at least fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from retrofit.ops._common import (
    block_attention, check_num_past, compute_dtype, drop_unseen_past, from_blocks, grouped_attend, grouped_scores,
    real_tokens,
)
from retrofit.ops.sliding_window import (
    block_layout, dense_window_mask, sliding_window_attention, sliding_window_attention_reference,
)

__all__ = [
    "LavoState",
    "lavo_attention",
    "lavo_attention_reference",
    "local_attention",
    "local_attention_reference",
    "orthogonal_memory_attention",
    "orthogonal_memory_attention_reference",
    "orthogonal_memory_recurrent",
    "orthogonal_memory_step",
]


# --------------------------------------------------------------------------------------
# orthogonal memory


@dataclass
class LavoState:
    """Recurrent state of the orthogonal memory for one layer.

    committed: ``(B, H, r)`` sum of ``B x_s`` over the tokens the next token can read;
    count: ``(B,)`` long, how many tokens that is (a multiple of the block when dissected);
    pending: ``(B, H, r)`` sum over the current, still incomplete block (zeros when undissected);
    pending_count: ``(B,)`` long, tokens in that block. ``count + pending_count`` = real tokens seen.
    """

    committed: torch.Tensor
    count: torch.Tensor
    pending: torch.Tensor
    pending_count: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, bases: int, *, device=None, dtype=torch.float32) -> "LavoState":
        return cls(
            committed=torch.zeros(batch, heads, bases, device=device, dtype=dtype),
            count=torch.zeros(batch, dtype=torch.long, device=device),
            pending=torch.zeros(batch, heads, bases, device=device, dtype=dtype),
            pending_count=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def seen(self) -> torch.Tensor:
        return self.count + self.pending_count

    def detach(self) -> "LavoState":
        return LavoState(self.committed.detach(), self.count, self.pending.detach(), self.pending_count)

    def index_select(self, batch_index: torch.Tensor) -> "LavoState":
        return LavoState(
            self.committed.index_select(0, batch_index), self.count.index_select(0, batch_index),
            self.pending.index_select(0, batch_index), self.pending_count.index_select(0, batch_index),
        )


def _check_block(block: int | None) -> None:
    if block is not None and block < 1:
        raise ValueError(f"memory block must be >= 1 or None, got {block}")


def _read(q: torch.Tensor, h: torch.Tensor, bases: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax_i(scaling * H_i (q . b_i)) weighted sum of H_i b_i. q ``(B,H,T,d)``, h ``(B,H,T,r)``."""
    qb = torch.einsum("bhtd,hrd->bhtr", q, bases)
    p = torch.softmax(scaling * h * qb, dim=-1)
    return torch.einsum("bhtr,hrd->bhtd", p * h, bases)


def _orthogonal_memory(
    q: torch.Tensor,
    x: torch.Tensor,
    bases: torch.Tensor,
    block: int | None,
    scaling: float,
    valid: torch.Tensor | None,
    state: LavoState | None,
) -> tuple[torch.Tensor, torch.Tensor, LavoState]:
    """Parallel memory: returns ``(out (B,H,T,d) compute dtype, visible count (B,T) long, final state)``."""
    _check_block(block)
    Bsz, H, T, d = x.shape
    r = bases.shape[1]
    dtype = compute_dtype(q, x, bases)
    if state is None:
        state = LavoState.empty(Bsz, H, r, device=x.device, dtype=dtype)
    valid = real_tokens(valid, Bsz, T, x.device)
    bb = bases.to(dtype)
    coef = torch.einsum("bhtd,hrd->bhtr", x.to(dtype), bb) * valid[:, None, :, None]
    committed0, pending0 = state.committed.to(dtype), state.pending.to(dtype)
    count0, seen0 = state.count, state.seen
    cv = torch.cumsum(valid.long(), dim=1)  # (B, T) real tokens up to and including t
    rank = seen0[:, None] + cv - 1
    if T == 0:
        return q.new_zeros(Bsz, H, 0, d, dtype=dtype), cv, state
    cum = torch.cumsum(coef, dim=2)

    if block is None:
        vis_count = seen0[:, None] + cv
        vis_sum = (committed0 + pending0)[:, :, None] + cum
    else:
        vis_count = block * torch.div(rank, block, rounding_mode="floor")  # (B, T)
        j = vis_count - seen0[:, None]  # visible new tokens; < 0 only when vis_count == count0
        # cum at the j-th real new token (first t with cv >= j); j <= cv - 1 so it lies at or before t
        pos = torch.searchsorted(cv.contiguous(), j.clamp(min=1).contiguous()).clamp(max=T - 1)  # padding rows: masked below
        new_part = cum.gather(2, pos[:, None, :, None].expand(-1, H, -1, r)) * (j >= 1)[:, None, :, None]
        old = torch.where((j >= 0)[:, None, :, None], (committed0 + pending0)[:, :, None], committed0[:, :, None])
        vis_sum = old + new_part
    vis_count = vis_count.masked_fill(~valid, 0)
    h = vis_sum / vis_count.clamp(min=1)[:, None, :, None].to(dtype)
    out = _read(q.to(dtype), h, bb, scaling) * valid[:, None, :, None]

    total = seen0 + cv[:, -1]
    if block is None:
        final = LavoState(committed0 + pending0 + cum[:, :, -1], total, torch.zeros_like(pending0), torch.zeros_like(total))
    else:
        new_count = block * torch.div(total, block, rounding_mode="floor")
        to_commit = (valid & (rank < new_count[:, None])).to(dtype)[:, None, :, None]
        commit_new = (coef * to_commit).sum(dim=2)
        pend_new = (coef * (1 - to_commit)).sum(dim=2)
        flushed = (new_count > count0)[:, None, None]  # the old pending block completed
        final = LavoState(
            committed0 + torch.where(flushed, pending0, torch.zeros_like(pending0)) + commit_new,
            new_count,
            torch.where(flushed, torch.zeros_like(pending0), pending0) + pend_new,
            total - new_count,
        )
    return out, vis_count, final


def orthogonal_memory_attention(
    q: torch.Tensor,
    x: torch.Tensor,
    bases: torch.Tensor,
    *,
    block: int | None = None,
    scaling: float = 1.0,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LavoState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LavoState | None]:
    """Causal orthogonal-memory attention in O(T r d) (eqs. 3-4); continues ``initial_state`` if given.

    Args:
        q: ``(B, H, T, d)`` queries that read the memory.
        x: ``(B, H, T, d)`` memory inputs.
        bases: ``(H, r, d)`` the ``r`` bases per head.
        block: None: token t reads the memory of s <= t (eq. 4); ``w``: only the complete windows
            of ``w`` tokens before its own (context dissection).
        scaling: multiplies the read logits (the paper's eq. 4 has none: 1.0).
        key_padding_mask: ``(B, T)`` bool, True for real tokens; padding is neither stored nor
            read, and its output is 0.
        initial_state: the :class:`LavoState` to continue from (None: empty).
        output_final_state: also return the state after the last token.

    Returns:
        ``(out, state)``: ``out`` ``(B, H, T, d)`` in ``x.dtype``; the final :class:`LavoState`
        (sums ``(B, H, r)``, counts ``(B,)``) if requested, else None.

    Example:
        >>> import torch
        >>> from retrofit.ops import orthogonal_memory_attention
        >>> bases = torch.linalg.qr(torch.randn(2, 8, 3))[0].transpose(1, 2)  # (H, r, d): orthonormal rows
        >>> q, x = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
        >>> out, state = orthogonal_memory_attention(q, x, bases, block=4, output_final_state=True)
        >>> out.shape, state.committed.shape, int(state.count)
        (torch.Size([1, 2, 12, 8]), torch.Size([1, 2, 3]), 12)
    """
    out, _, state = _orthogonal_memory(q, x, bases, block, scaling, key_padding_mask, initial_state)
    return out.to(x.dtype), (state if output_final_state else None)


def orthogonal_memory_attention_reference(
    q: torch.Tensor,
    x: torch.Tensor,
    bases: torch.Tensor,
    *,
    block: int | None = None,
    scaling: float = 1.0,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Direct O(T^2 r d) evaluation of eqs. 3-4 (tests only).

    An explicit visibility matrix, the mean ``H_t``, the memory ``X~_t = B * H_t`` ``(r, d)`` and
    ``softmax(q X~^T) X~``.

    Args:
        q: ``(B, H, T, d)`` queries that read the memory.
        x: ``(B, H, T, d)`` memory inputs.
        bases: ``(H, r, d)`` the ``r`` bases per head.
        block: None (eq. 4) or the dissection window ``w``.
        scaling: multiplies the read logits.
        key_padding_mask: ``(B, T)`` bool, True for real tokens.

    Returns:
        ``(B, H, T, d)`` in ``x.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import orthogonal_memory_attention_reference
        >>> bases = torch.linalg.qr(torch.randn(2, 8, 3))[0].transpose(1, 2)
        >>> q, x = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
        >>> orthogonal_memory_attention_reference(q, x, bases, block=4).shape
        torch.Size([1, 2, 12, 8])
    """
    _check_block(block)
    Bsz, H, T, d = x.shape
    dtype = compute_dtype(q, x, bases)
    valid = real_tokens(key_padding_mask, Bsz, T, x.device)
    rank = torch.cumsum(valid.long(), dim=1) - 1
    rt, rs = rank[:, :, None], rank[:, None, :]
    if block is None:
        visible = rs <= rt
    else:
        visible = rs < block * torch.div(rt, block, rounding_mode="floor")
    visible = visible & valid[:, None, :] & valid[:, :, None]  # (B, t, s)
    weights = visible.to(dtype) / visible.sum(-1, keepdim=True).clamp(min=1).to(dtype)
    coef = torch.einsum("bhsd,hrd->bhsr", x.to(dtype), bases.to(dtype))
    h = torch.einsum("bts,bhsr->bhtr", weights, coef)
    memory = h[..., None] * bases.to(dtype)[None, :, None]  # (B, H, T, r, d)
    scores = torch.einsum("bhtd,bhtrd->bhtr", q.to(dtype), memory) * scaling
    out = torch.einsum("bhtr,bhtrd->bhtd", torch.softmax(scores, dim=-1), memory)
    return (out * valid[:, None, :, None]).to(x.dtype)


def orthogonal_memory_step(
    q: torch.Tensor,
    x: torch.Tensor,
    bases: torch.Tensor,
    state: LavoState,
    *,
    block: int | None = None,
    scaling: float = 1.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LavoState]:
    """One decoding token of the orthogonal memory: O(r d) per head.

    Args:
        q: ``(B, H, d)`` the new token's query.
        x: ``(B, H, d)`` its memory input.
        bases: ``(H, r, d)`` the bases.
        state: the :class:`LavoState` before the token.
        block: None (eq. 4) or the dissection window ``w``.
        scaling: multiplies the read logits.
        valid: ``(B,)`` bool; False (padding) leaves the state untouched and outputs 0.

    Returns:
        ``(out, state)``: ``out`` ``(B, H, d)`` in ``x.dtype``; the state after the token.

    Example:
        >>> import torch
        >>> from retrofit.ops import LavoState, orthogonal_memory_step
        >>> bases = torch.linalg.qr(torch.randn(2, 8, 3))[0].transpose(1, 2)
        >>> q, x = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
        >>> out, state = orthogonal_memory_step(q, x, bases, LavoState.empty(1, 2, 3))
        >>> out.shape, int(state.seen)
        (torch.Size([1, 2, 8]), 1)
    """
    _check_block(block)
    dtype = compute_dtype(q, x, bases, state.committed)
    Bsz = x.shape[0]
    ok = torch.ones(Bsz, dtype=torch.bool, device=x.device) if valid is None else valid.bool()
    bb = bases.to(dtype)
    coef = torch.einsum("bhd,hrd->bhr", x.to(dtype), bb) * ok[:, None, None]
    committed, pending = state.committed.to(dtype), state.pending.to(dtype)
    count, pcount = state.count, state.pending_count
    if block is None:
        committed = committed + pending + coef
        count = count + pcount + ok.long()
        pending, pcount = torch.zeros_like(pending), torch.zeros_like(pcount)
        h = committed / count.clamp(min=1)[:, None, None].to(dtype)
    else:
        h = committed / count.clamp(min=1)[:, None, None].to(dtype)  # read complete blocks only
        pending = pending + coef
        pcount = pcount + ok.long()
        full = pcount >= block
        committed = torch.where(full[:, None, None], committed + pending, committed)
        pending = torch.where(full[:, None, None], torch.zeros_like(pending), pending)
        count = torch.where(full, count + pcount, count)
        pcount = torch.where(full, torch.zeros_like(pcount), pcount)
    out = _read(q.to(dtype)[:, :, None], h[:, :, None], bb, scaling)[:, :, 0] * ok[:, None, None]
    return out.to(x.dtype), LavoState(committed, count, pending, pcount)


def orthogonal_memory_recurrent(
    q: torch.Tensor,
    x: torch.Tensor,
    bases: torch.Tensor,
    *,
    block: int | None = None,
    scaling: float = 1.0,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LavoState | None = None,
) -> tuple[torch.Tensor, LavoState]:
    """Token-by-token loop over :func:`orthogonal_memory_step` (decoding path; a second reference).

    Args:
        q: ``(B, H, T, d)`` queries that read the memory.
        x: ``(B, H, T, d)`` memory inputs.
        bases: ``(H, r, d)`` the bases.
        block: None (eq. 4) or the dissection window ``w``.
        scaling: multiplies the read logits.
        key_padding_mask: ``(B, T)`` bool, True for real tokens.
        initial_state: the :class:`LavoState` to continue from (None: empty).

    Returns:
        ``(out, state)``: ``out`` ``(B, H, T, d)``; the final :class:`LavoState`.

    Example:
        >>> import torch
        >>> from retrofit.ops import orthogonal_memory_recurrent
        >>> bases = torch.linalg.qr(torch.randn(2, 8, 3))[0].transpose(1, 2)
        >>> q, x = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> out, state = orthogonal_memory_recurrent(q, x, bases, block=4)
        >>> out.shape, int(state.count), int(state.pending_count)
        (torch.Size([1, 2, 6, 8]), 4, 2)
    """
    Bsz, H, T, _ = x.shape
    state = initial_state or LavoState.empty(Bsz, H, bases.shape[1], device=x.device, dtype=compute_dtype(q, x, bases))
    outs = []
    for t in range(T):
        valid = None if key_padding_mask is None else key_padding_mask[:, t]
        o, state = orthogonal_memory_step(q[:, :, t], x[:, :, t], bases, state, block=block, scaling=scaling, valid=valid)
        outs.append(o)
    out = torch.stack(outs, dim=2) if outs else x.new_zeros(x.shape)
    return out, state


# --------------------------------------------------------------------------------------
# local windowed attention with a relative position bias


def _check_bias(rel_bias: torch.Tensor, heads: int, window: int) -> None:
    if rel_bias.dim() != 2 or rel_bias.shape[1] != window or rel_bias.shape[0] not in (1, heads):
        raise ValueError(f"rel_bias must be (heads={heads} or 1, window={window}), got {tuple(rel_bias.shape)}")


def local_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    rel_bias: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
) -> torch.Tensor:
    """Dense O(Tq * Tk) local attention with a relative position bias (reference and short query blocks).

    Without ``rel_bias`` this is exactly :func:`sliding_window_attention_reference`.

    Args:
        q, k, v, window, rel_bias, scaling, softcap, key_padding_mask, num_past: as :func:`local_attention`.

    Returns:
        ``(B, Hq, Tq, Dv)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import local_attention_reference
        >>> q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
        >>> local_attention_reference(q, k, v, 4, rel_bias=torch.randn(4, 4)).shape
        torch.Size([1, 4, 10, 8])
    """
    if rel_bias is None:
        return sliding_window_attention_reference(
            q, k, v, window, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, num_past=num_past
        )
    B, Hq, Tq, _ = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    check_num_past(q, k, num_past)
    _check_bias(rel_bias, Hq, window)
    scores = grouped_scores(q, k, scaling, softcap)
    delta = torch.arange(Tq, device=q.device)[:, None] + num_past - torch.arange(Tk, device=q.device)[None, :]
    bias = rel_bias.to(scores.dtype).expand(Hq, window)[:, delta.clamp(0, window - 1)]  # (Hq, Tq, Tk)
    scores = scores + bias.view(1, Hkv, Hq // Hkv, Tq, Tk)
    allowed, q_valid = dense_window_mask(Tq, Tk, window, key_padding_mask, num_past, q.device)
    out = grouped_attend(scores.masked_fill(~allowed[:, None], float("-inf")), v)
    if q_valid is not None:
        out = out * q_valid.view(B, 1, Tq, 1).to(out.dtype)
    return out


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    rel_bias: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
) -> torch.Tensor:
    """Blocked O(Tq * 2w) sliding-window attention with a relative position bias.

    Without ``rel_bias`` this is :func:`retrofit.ops.sliding_window_attention`. With it, the
    same blocking (queries in blocks of ``w`` against their own and the previous key block)
    with the bias folded into a float SDPA mask (differentiable w.r.t. ``rel_bias``).

    Args:
        q: ``(B, Hq, Tq, d)`` queries.
        k: ``(B, Hkv, num_past + Tq, d)`` keys (``Hq % Hkv == 0``).
        v: ``(B, Hkv, num_past + Tq, Dv)`` values.
        window: ``w``: query t sees keys ``t - w < s <= t``.
        rel_bias: ``(Hq or 1, w)`` added to the score of the key at distance ``delta``
            (``rel_bias[h, delta]``), after scaling and soft-capping; None: no bias.
        scaling: score scale (default ``d ** -0.5``).
        softcap: ``softcap * tanh(score / softcap)`` when set.
        key_padding_mask: ``(B, num_past + Tq)`` bool, True for real tokens; padded queries output 0.
        num_past: cached keys in front of the queries' own.

    Returns:
        ``(B, Hq, Tq, Dv)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import local_attention
        >>> q, k, v = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
        >>> local_attention(q, k, v, 8, rel_bias=torch.randn(1, 8)).shape
        torch.Size([1, 4, 32, 8])
    """
    if rel_bias is None:
        return sliding_window_attention(
            q, k, v, window, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask, num_past=num_past
        )
    B, Hq, Tq, d = q.shape
    Hkv = k.shape[1]
    check_num_past(q, k, num_past)
    _check_bias(rel_bias, Hq, window)
    k, v, num_past, key_padding_mask = drop_unseen_past(k, v, num_past, window, key_padding_mask)
    if Tq <= window:
        return local_attention_reference(
            q, k, v, window, rel_bias=rel_bias, scaling=scaling, softcap=softcap,
            key_padding_mask=key_padding_mask, num_past=num_past,
        )
    w, group = window, Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    qb, (kb, vb), allowed, q_valid, n = block_layout(q, (k, v), w, num_past, key_padding_mask)

    # padded key j of a block is at distance a + w - j from its query a
    delta = torch.arange(w, device=q.device)[:, None] + w - torch.arange(2 * w, device=q.device)[None, :]
    score_dtype = torch.promote_types(q.dtype, torch.float32) if softcap else q.dtype
    bias = rel_bias.to(score_dtype).expand(Hq, w)[:, delta.clamp(0, w - 1)].view(1, Hkv, 1, group * w, 2 * w)
    mask = bias.masked_fill(~allowed, float("-inf")).expand(B, Hkv, n, group * w, 2 * w)

    out = from_blocks(block_attention(qb, kb, vb, mask, scaling, softcap), group)[:, :, :Tq]
    if key_padding_mask is not None:
        out = out * q_valid.reshape(B, 1, n * w, 1)[:, :, :Tq].to(out.dtype)
    return out


# --------------------------------------------------------------------------------------
# LAVO = local + dissected orthogonal memory


def _gate(global_weight: float | torch.Tensor, heads: int, dtype: torch.dtype, device) -> torch.Tensor:
    g = torch.as_tensor(global_weight, dtype=dtype, device=device)
    if g.dim() == 0:
        return g.view(1, 1, 1, 1)
    if g.numel() != heads:
        raise ValueError(f"global_weight must be a scalar or one value per query head ({heads}), got {tuple(g.shape)}")
    return g.reshape(1, heads, 1, 1)


def lavo_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bases: torch.Tensor,
    *,
    window: int,
    rel_bias: torch.Tensor | None = None,
    global_query: torch.Tensor | None = None,
    global_weight: float | torch.Tensor = 0.5,
    dissect: bool = True,
    scaling: float | None = None,
    memory_scaling: float = 1.0,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    num_past: int = 0,
    initial_state: LavoState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LavoState | None]:
    """LAVO in O(T (w d + r d)): local windowed attention mixed with the orthogonal memory of the local outputs.

    Also the decoding / chunked-prefill form: pass ``num_past`` cached keys/values in front of
    k/v (``key_padding_mask`` then covers ``num_past + Tq``) and the memory state of the tokens
    before.

    Args:
        q: ``(B, Hq, Tq, d)`` queries of the local attention.
        k: ``(B, Hkv, num_past + Tq, d)`` keys (``Hq % Hkv == 0``).
        v: ``(B, Hkv, num_past + Tq, D)`` values.
        bases: ``(Hq, r, D)`` the memory's bases.
        window: ``w``: the local window and the dissection block.
        rel_bias: ``(Hq or 1, w)`` relative position bias of the local attention (None: none).
        global_query: ``(B, Hq, Tq, D)`` reads the memory (default: q, which then needs d = D).
        global_weight: ``g``, a scalar or ``(Hq,)`` (may carry gradients): ``out = (1 - g) local
            + g global`` where the memory holds something, else ``local``.
        dissect: True reads complete windows only (sec. 3.2); False uses eq. 4 (all s <= t).
        scaling: local score scale (default ``d ** -0.5``).
        memory_scaling: multiplies the memory's read logits.
        softcap: ``softcap * tanh(score / softcap)`` on the local scores when set.
        key_padding_mask: ``(B, num_past + Tq)`` bool, True for real tokens; padded queries output 0.
        num_past: cached keys in front of the queries' own.
        initial_state: the memory's :class:`LavoState` after the tokens before (None: empty).
        output_final_state: also return the memory state after the last token.

    Returns:
        ``(out, state)``: ``out`` ``(B, Hq, Tq, D)`` in ``v.dtype``; the final :class:`LavoState`
        if requested, else None.

    Example:
        >>> import torch
        >>> from retrofit.ops import lavo_attention
        >>> q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
        >>> bases = torch.linalg.qr(torch.randn(4, 8, 3))[0].transpose(1, 2)  # (Hq, r, D)
        >>> out, state = lavo_attention(q, k, v, bases, window=8, output_final_state=True)
        >>> out.shape, int(state.count)
        (torch.Size([1, 4, 20, 8]), 16)
    """
    Hq = q.shape[1]
    local = local_attention(
        q, k, v, window, rel_bias=rel_bias, scaling=scaling, softcap=softcap,
        key_padding_mask=key_padding_mask, num_past=num_past,
    )
    qg = q if global_query is None else global_query
    q_valid = None if key_padding_mask is None else key_padding_mask[:, num_past:]
    glob, count, state = _orthogonal_memory(qg, local, bases, window if dissect else None, memory_scaling, q_valid, initial_state)
    g = _gate(global_weight, Hq, glob.dtype, glob.device) * (count > 0)[:, None, :, None].to(glob.dtype)
    local_c = local.to(glob.dtype)
    out = local_c + g * (glob - local_c)
    return out.to(v.dtype), (state if output_final_state else None)


def lavo_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bases: torch.Tensor,
    *,
    window: int,
    rel_bias: torch.Tensor | None = None,
    global_query: torch.Tensor | None = None,
    global_weight: float | torch.Tensor = 0.5,
    dissect: bool = True,
    scaling: float | None = None,
    memory_scaling: float = 1.0,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense references of both branches and the gated average (tests only).

    Args:
        q, k, v, bases, window, rel_bias, global_query, global_weight, dissect, scaling, memory_scaling,
            softcap, key_padding_mask: as :func:`lavo_attention` (no cached keys: ``Tk = Tq = T``).

    Returns:
        ``(B, Hq, T, D)`` in ``v.dtype``.

    Example:
        >>> import torch
        >>> from retrofit.ops import lavo_attention_reference
        >>> q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
        >>> bases = torch.linalg.qr(torch.randn(4, 8, 3))[0].transpose(1, 2)
        >>> lavo_attention_reference(q, k, v, bases, window=8).shape
        torch.Size([1, 4, 20, 8])
    """
    B, Hq, T, _ = q.shape
    local = local_attention_reference(q, k, v, window, rel_bias=rel_bias, scaling=scaling, softcap=softcap, key_padding_mask=key_padding_mask)
    qg = q if global_query is None else global_query
    block = window if dissect else None
    glob = orthogonal_memory_attention_reference(qg, local, bases, block=block, scaling=memory_scaling, key_padding_mask=key_padding_mask)
    valid = real_tokens(key_padding_mask, B, T, q.device)
    rank = torch.cumsum(valid.long(), dim=1) - 1
    nonempty = (rank >= 0) if block is None else (rank >= block)
    dtype = torch.float64
    g = _gate(global_weight, Hq, dtype, q.device) * (nonempty & valid)[:, None, :, None].to(dtype)
    out = local.to(dtype) + g * (glob.to(dtype) - local.to(dtype))
    return out.to(v.dtype)
