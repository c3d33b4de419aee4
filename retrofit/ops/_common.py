"""Pieces the attention ops share: dtypes, soft-capping, cached-key checks and the blocked layout.

Shapes follow the ops': q ``(B, Hq, Tq, d)``, k ``(B, Hkv, Tk, d)``, v ``(B, Hkv, Tk, Dv)`` with
``Hq % Hkv == 0`` (grouped-query attention), ``Tk = num_past + Tq`` where the first ``num_past``
keys are cached ones before the queries' own, and ``key_padding_mask`` ``(B, Tk)`` True for real
tokens.

The blocked layout (sliding window, LAVO's local branch, LLP): queries in blocks of ``b``, each
block against ``2b`` keys, the previous key block and its own. Keys are front-padded so that the
key of query 0 sits at padded index ``b`` (:func:`two_blocks`); the queries of a GQA group are
stacked per block (:func:`query_blocks`) and put back by :func:`from_blocks`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "block_attention", "check_num_past", "compute_dtype", "drop_unseen_past", "from_blocks", "grouped_attend",
    "grouped_scores", "query_blocks", "real_tokens", "soft_cap", "two_blocks", "upcast", "window_keys",
]


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """fp32, or wider when one of ``xs`` is (fp64): the dtype a state or a softmax is computed in."""
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 scores go to fp32 for the softmax; fp32/fp64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)``; ``scores`` unchanged without a cap (None or <= 0)."""
    if softcap is None or softcap <= 0:
        return scores
    return torch.tanh(scores / softcap) * softcap


def real_tokens(key_padding_mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """``key_padding_mask`` ``(B, T)`` as bool, True for real tokens; without one, every token of
    ``(batch, length)`` is real."""
    if key_padding_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    return key_padding_mask.bool()


# ---------------------------------------------------------------------- cached keys
def check_num_past(q: torch.Tensor, k: torch.Tensor, num_past: int) -> None:
    """ValueError unless the keys ``k`` ``(B, Hkv, Tk, d)`` are ``num_past`` cached ones and the
    queries' own: ``Tk = num_past + Tq`` for ``q`` ``(B, Hq, Tq, d)``."""
    Tq, Tk = q.shape[2], k.shape[2]
    if Tk != num_past + Tq:
        raise ValueError(f"keys ({Tk}) must be num_past ({num_past}) + queries ({Tq})")


def drop_unseen_past(
    k: torch.Tensor, v: torch.Tensor | None, num_past: int, window: int, mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]:
    """Only the last ``w - 1`` cached keys can be seen by the first query: drop the rest of ``k``,
    ``v`` (None: keys only) and the key padding ``mask``. Returns ``(k, v, num_past, mask)``."""
    if num_past > window:
        drop = num_past - window
        k = k[:, :, drop:]
        v = None if v is None else v[:, :, drop:]
        mask = None if mask is None else mask[:, drop:]
        num_past = window
    return k, v, num_past, mask


def window_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, window: int, num_past: int,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]:
    """The keys a ``window``-token sliding window over ``q`` reads: :func:`check_num_past`, then
    :func:`drop_unseen_past`. Returns ``(k, v, num_past, mask)``."""
    check_num_past(q, k, num_past)
    return drop_unseen_past(k, v, num_past, window, mask)


# ---------------------------------------------------------------------- dense grouped scores
def grouped_scores(q: torch.Tensor, k: torch.Tensor, scaling: float | None, softcap: float | None) -> torch.Tensor:
    """Every query's scaled, soft-capped scores against every key, the query heads of a GQA group
    side by side: ``(B, Hkv, group, Tq, Tk)`` in fp32 or wider (``scaling`` None: ``d ** -0.5``)."""
    B, Hq, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scaling = d**-0.5 if scaling is None else scaling
    scores = upcast(torch.matmul(q.reshape(B, Hkv, (Hq // Hkv) * Tq, d), k.transpose(-1, -2))) * scaling
    return soft_cap(scores, softcap).view(B, Hkv, Hq // Hkv, Tq, Tk)


def grouped_attend(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The softmax of masked :func:`grouped_scores` ``(B, Hkv, group, Tq, Tk)`` over the values
    ``v`` ``(B, Hkv, Tk, Dv)``: ``(B, Hq, Tq, Dv)`` in ``v.dtype``."""
    B, Hkv, group, Tq, Tk = scores.shape
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs.view(B, Hkv, group * Tq, Tk), v).view(B, Hkv * group, Tq, -1)


# ---------------------------------------------------------------------- blocked layout
def two_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Front-padded keys ``(..., (n + 1) b, c)`` -> ``(..., n, 2b, c)``: block ``j`` holds padded key
    blocks ``j`` and ``j + 1`` (the previous and the own block of query block ``j``)."""
    n = x.shape[-2] // block - 1
    prev = x[..., : n * block, :].unflatten(-2, (n, block))
    cur = x[..., block:, :].unflatten(-2, (n, block))
    return torch.cat([prev, cur], dim=-2)


def query_blocks(q: torch.Tensor, heads_kv: int, block: int, tail: int) -> torch.Tensor:
    """Queries ``(B, Hq, T, d)``, padded with ``tail`` rows to ``n`` blocks of ``b``, as
    ``(B, Hkv, n, group b, d)``: the query heads of a GQA group stacked per block."""
    B, Hq, T, d = q.shape
    n = (T + tail) // block
    qb = F.pad(q, (0, 0, 0, tail)).view(B, heads_kv, Hq // heads_kv, n, block, d)
    return qb.permute(0, 1, 3, 2, 4, 5).reshape(B, heads_kv, n, (Hq // heads_kv) * block, d)


def from_blocks(x: torch.Tensor, group: int) -> torch.Tensor:
    """Undo :func:`query_blocks` on a per-query result: ``(B, Hkv, n, group b[, c])`` -> ``(B, Hq,
    n b[, c])``, the query heads of each GQA group back in order."""
    B, Hkv, n, gw, *rest = x.shape
    return x.view(B, Hkv, n, group, gw // group, *rest).transpose(2, 3).reshape(B, Hkv * group, n * (gw // group), *rest)


def block_attention(
    qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor, scaling: float, softcap: float | None,
) -> torch.Tensor:
    """Softmax attention of query blocks ``qb`` ``(B, Hkv, n, group b, d)`` over their keys ``kb``,
    ``vb`` ``(B, Hkv, n, 2b, d|Dv)`` under ``mask`` (bool: which keys are seen; float: added to the
    scores, -inf where unseen), broadcast to ``(B, Hkv, n, group b, 2b)``: ``(B, Hkv, n, group b, Dv)``
    in ``vb.dtype``. SDPA without soft-capping; with it (which SDPA cannot express) scores, softmax
    and value product in fp32 or wider."""
    if softcap is None or softcap <= 0:
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scaling)
    scores = soft_cap(upcast(torch.matmul(qb, kb.transpose(-1, -2))) * scaling, softcap)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1).to(vb.dtype), vb)
