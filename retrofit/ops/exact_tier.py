"""Three tiers of memory beside a pretrained attention: a window, a bounded tier of exact tokens, a linear read.

Query ``t`` attends, in one normalisation, to

* its *exact* keys, scored by the pretrained softmax: the sinks (the first ``n`` real tokens), the
  tokens not yet settled (``F(t) <= s <= t``: the window of at least ``w`` tokens) and the *tier*:
  at most ``capacity`` tokens per KV head kept, exactly, from those that left the window;
* the *memory*: a Hedgehog linear read (:mod:`retrofit.ops.hedgehog`) of every other older token,
  weighed against the exact keys as the layer's Hedgehog read is weighed against its window:

      o_t = (1 - p_t) exact_t + p_t num_t / mass_t,   p_t = sigmoid(log mass_t + c_t - lse_t)

  with ``lse_t`` the log-sum-exp of the exact scores and ``c_t = scale_t + g_h log n_t`` the read's
  log-scale (``n_t`` the tokens in the memory). Nothing is counted twice or lost: every older real
  token is in exactly one tier.

Tokens settle in blocks of ``block`` (``C``): ``F(t) = C floor((t - w + 1) / C)`` (at least 0), so
the window holds ``w`` to ``w + C - 1`` tokens. When ``F`` advances by ``C``, the block leaving the
window and the tier's members compete: the ``capacity`` with the highest score stay (ties: the
newer token), the rest go into the memory for good. Because settling happens only at these
points, a prefill and a token-by-token decode do exactly the same settling, and the tier, the
memory and the window stay bounded: the decoding cost per token does not grow with the context.

**Block retrieval** (``retrieve = k > 0``, with ``capacity = 0``; the unbounded mode of InfLLM and
LongHeads): every settled block is also *stored* (its read keys and values), and each query reads
exactly, beside its window and sinks, the ``k`` stored blocks it ranks highest (ties: the older
block), by ``retrieve_score``:

* ``"max"``: the block's best read score ``max_s mq . mk_s`` (every stored key scored, as full
  attention scores them; only ``k C`` are read);
  Blocks whose best keys are one token at one position-free key tie exactly; rounding, which differs
  between a prefill's and a decoding step's matrix shapes, may then pick a different one of them;
* ``"bound"``: Quest's bound ``sum_j max(mq_j lo_j, mq_j hi_j)`` from the element-wise minimum
  ``lo`` and maximum ``hi`` of the block's keys (``T / C`` scores per query, but a loose ranking: on
  SmolLM2 it misses the needle's block in most heads of the upper layers, docs/findings.md).

The memory still holds every settled token, so a retrieved token is counted twice (exactly, and in
the read): the read's share then falls as the retrieved scores raise ``lse_t``. The cache grows with
the context (the store).

Scores (``rule``), per KV head over its query heads' memories:

* ``"recall"`` (LoLA, McDermott et al. 2025): the self-recall error ``|v - phi(k)^T S / phi(k)^T z|``
  of the token through the memory as it is before the block settles (the mean over the group's
  query heads): what the linear read would get wrong is kept exact;
* ``"norm"``: the key's norm (outlying keys dominate the scores they take part in);
* ``"recency"``: the newest tokens, i.e. a window longer by ``capacity`` (the fair baseline: the
  same bytes spent on a longer window).

Tier keys are scored with the read's queries and keys (``mq``, ``mk``: position-free with the
Hedgehog read's ``memory_distance``, else the pretrained post-RoPE ones); the sinks and the window
with the pretrained ones (sinks farther than ``sink_distance`` at that distance, as
:mod:`retrofit.ops.sinks` scores them).

Shapes: queries ``(B, Hq, T, d)``, keys ``(B, Hkv, T, d)``, values ``(B, Hkv, T, D)``, features
``(B, Hq, T, 2f)``; the state's tensors as in :class:`TierState`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from retrofit.ops.hedgehog import hedgehog_features
from retrofit.ops.rope import rope_rotate
from retrofit.ops.sdpa import repeat_kv_heads

__all__ = ["RETRIEVE_SCORES", "TIER_RULES", "TierState", "settle_frontier", "tiered_attention", "tiered_attention_reference"]

TIER_RULES = ("recall", "norm", "recency")
RETRIEVE_SCORES = ("max", "bound")

# Block retrieval ranked by the key bound runs a prefill this many queries at a time: the union of blocks they
# choose (what is gathered and scored) stays small where a whole segment's union would cover most of the store.
# Ranked by the best score every stored key is scored anyway, so a segment runs whole.
RETRIEVAL_QUERIES = 16


def _rep(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` with each KV head (dim 1) repeated over its ``group`` query heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


@dataclass
class TierState:
    """One layer's three tiers between calls (all bounded).

    * window buffer, from stream index ``frontier``: ``keys`` / ``read_keys`` ``(B, Hkv, P, d)``,
      ``values`` ``(B, Hkv, P, D)``, ``valid`` ``(B, P)`` (``P <= w + C - 1`` after a call);
    * tier: ``tier_keys`` (read keys) ``(B, Hkv, capacity, d)``, ``tier_values`` ``(B, Hkv, capacity, D)``,
      ``tier_index`` ``(B, Hkv, capacity)`` stream indices (``-1``: empty slot);
    * memory: ``S`` ``(B, Hq, F, D)``, ``z`` ``(B, Hq, F)`` fp32 at least, ``count`` ``(B, Hkv)`` tokens in it;
    * store (block retrieval only, else empty): ``store_keys`` ``(B, Hkv, N, d)``, ``store_values``
      ``(B, Hkv, N, D)``, ``store_valid`` ``(B, N)`` every settled token in stream order (``N = frontier``),
      ``store_lo`` / ``store_hi`` ``(B, Hkv, N / C, d)`` each block's key bounds;
    * ``frontier``: the stream index of the first unsettled token; ``length``: tokens seen.
    """

    keys: torch.Tensor
    read_keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    tier_keys: torch.Tensor
    tier_values: torch.Tensor
    tier_index: torch.Tensor
    S: torch.Tensor
    z: torch.Tensor
    count: torch.Tensor
    store_keys: torch.Tensor
    store_values: torch.Tensor
    store_valid: torch.Tensor
    store_lo: torch.Tensor
    store_hi: torch.Tensor
    frontier: int = 0
    length: int = 0
    store_room: "_StoreRoom | None" = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held: the store's allocation (room to grow included) in place of its views."""
        held = [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)
                and not (self.store_room is not None and f.name.startswith("store_"))]
        return held if self.store_room is None else held + self.store_room.tensors()

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TierState":
        """A copy with ``fn`` applied to every tensor (device moves, beam reordering); its store has no room."""
        return replace(self, store_room=None, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                                 if isinstance(getattr(self, f.name), torch.Tensor)})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class _StoreRoom:
    """The store's tensors with room for later blocks (a state's ``store_*`` are views of their first ``N``
    tokens), so a prefill appends each block in place instead of copying the store ``T / C`` times. ``filled``:
    the tokens the newest state holds; only a state holding that many appends in place, any other copies."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    filled: int

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.valid, self.lo, self.hi]


def settle_frontier(t: int, window: int, block: int) -> int:
    """``F(t)``: the first stream index query ``t`` still reads as a window token."""
    return max(0, block * ((t - window + 1) // block))


def _empty_state(k: torch.Tensor, v: torch.Tensor, fq: torch.Tensor, capacity: int) -> TierState:
    B, Hkv, _, d = k.shape
    Hq, Fe, D = fq.shape[1], fq.shape[-1], v.shape[-1]
    acc = torch.promote_types(fq.dtype, torch.float32)
    return TierState(
        keys=k[:, :, :0], read_keys=k[:, :, :0], values=v[:, :, :0],
        valid=torch.ones(B, 0, dtype=torch.bool, device=k.device),
        tier_keys=k.new_zeros(B, Hkv, capacity, d), tier_values=v.new_zeros(B, Hkv, capacity, D),
        tier_index=torch.full((B, Hkv, capacity), -1, dtype=torch.long, device=k.device),
        S=fq.new_zeros(B, Hq, Fe, D, dtype=acc), z=fq.new_zeros(B, Hq, Fe, dtype=acc),
        count=torch.zeros(B, Hkv, dtype=acc, device=k.device),
        store_keys=k[:, :, :0], store_values=v[:, :, :0], store_valid=torch.ones(B, 0, dtype=torch.bool, device=k.device),
        store_lo=k[:, :, :0], store_hi=k[:, :, :0],
    )


def _capped(scores: torch.Tensor, scores_far: torch.Tensor | None, far: torch.Tensor | None) -> torch.Tensor:
    return scores if far is None else torch.where(far, scores_far, scores)


def _sink_scores(q, sinks, t, frontier, sink_distance, inv_freq):
    """Scores ``(B, Hq, R, n)`` of queries at positions ``t`` ``(R,)`` against the sinks settled before
    ``frontier`` (-inf elsewhere); pairs farther than ``sink_distance`` scored at that distance."""
    idx, ok, sk, _ = sinks
    group = q.shape[1] // sk.shape[1]
    s = q @ _rep(sk, group).transpose(-1, -2).to(q.dtype)
    if sink_distance and inv_freq is not None:
        far = (t[None, :, None] - idx[:, None, :]) > sink_distance  # (B, R, n)
        if bool(far.any()):
            q_far = rope_rotate(q, (sink_distance - t).to(q.dtype), inv_freq)
            k0 = rope_rotate(sk, -idx[:, None, :].to(q.dtype), inv_freq)
            s = torch.where(far[:, None], q_far @ _rep(k0, group).transpose(-1, -2).to(q.dtype), s)
    seen = ok & (idx < frontier)  # a sink at or after the frontier is a window token
    return s.masked_fill(~seen[:, None, None, :], float("-inf"))


def _softcapped(s: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """Scores scaled and soft-capped; -inf (a key not read) stays -inf (``tanh(-inf)`` alone is finite)."""
    s = s * scaling
    return _capped_only(s, softcap)


def _capped_only(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scaled scores soft-capped (-inf stays -inf); as they are without a cap."""
    return (torch.tanh(s / softcap) * softcap).masked_fill(s == float("-inf"), float("-inf")) if softcap else s


def _scores(rule: str, mk, v, index, S, z, feature_key_weight, group: int) -> torch.Tensor:
    """``(B, Hkv, N)`` selection scores of N candidate tokens (read keys ``mk``, values ``v``, ``index``)."""
    if rule == "recency":
        return index.to(S.dtype)
    if rule == "norm":
        return mk.to(S.dtype).norm(dim=-1)
    fk = hedgehog_features(_rep(mk, group), feature_key_weight).to(S.dtype)  # (B, Hq, N, F)
    num = fk @ S
    mass = (fk * z[:, :, None]).sum(-1, keepdim=True)
    pred = torch.where(mass > 0, num / mass.clamp_min(torch.finfo(S.dtype).tiny), torch.zeros_like(num))
    err = (_rep(v, group).to(S.dtype) - pred).norm(dim=-1)  # (B, Hq, N)
    B, Hq, N = err.shape
    return err.view(B, Hq // group, group, N).mean(2)


def _with_room(x: torch.Tensor, size: int, dim: int = 2) -> torch.Tensor:
    """``x`` copied to the front of a zero tensor ``size`` long along ``dim``."""
    buf = x.new_zeros(*x.shape[:dim], size, *x.shape[dim + 1:])
    buf.narrow(dim, 0, x.shape[dim]).copy_(x)
    return buf


def _stored(state: TierState, block: int, write: torch.Tensor) -> dict[str, torch.Tensor]:
    """The store with the settling block appended (its read keys, values, real-token mask and key bounds)."""
    k = state.read_keys[:, :, :block]
    ok = write[:, None, :, None]
    big = torch.finfo(k.dtype).max
    lo = torch.where(ok, k, torch.full_like(k, big)).amin(2, keepdim=True)
    hi = torch.where(ok, k, torch.full_like(k, -big)).amax(2, keepdim=True)
    empty = ~write.any(-1)[:, None, None, None]  # a block with no real token: bounds 0, never chosen
    lo, hi = lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)
    v = state.values[:, :, :block]
    if any(x.requires_grad for x in (k, v, state.store_keys, state.store_values)):  # autograd: no in-place writes
        return dict(store_keys=torch.cat([state.store_keys, k], 2), store_values=torch.cat([state.store_values, v], 2),
                    store_valid=torch.cat([state.store_valid, write], 1),
                    store_lo=torch.cat([state.store_lo, lo], 2), store_hi=torch.cat([state.store_hi, hi], 2))
    N, nb = state.store_keys.shape[2], state.store_lo.shape[2]
    room = state.store_room
    if room is None or room.filled != N or room.keys.shape[2] < N + block:  # a new allocation, half again as big
        cap = block * (nb + 1 + nb // 2)
        room = _StoreRoom(_with_room(state.store_keys, cap), _with_room(state.store_values, cap),
                          _with_room(state.store_valid, cap, dim=1), _with_room(state.store_lo, cap // block),
                          _with_room(state.store_hi, cap // block), filled=N)
    room.keys[:, :, N : N + block] = k
    room.values[:, :, N : N + block] = v
    room.valid[:, N : N + block] = write
    room.lo[:, :, nb : nb + 1], room.hi[:, :, nb : nb + 1] = lo, hi
    room.filled = N + block
    return dict(store_keys=room.keys[:, :, : N + block], store_values=room.values[:, :, : N + block],
                store_valid=room.valid[:, : N + block], store_lo=room.lo[:, :, : nb + 1], store_hi=room.hi[:, :, : nb + 1],
                store_room=room)


def _settle(state: TierState, block: int, capacity: int, rule: str, feature_key_weight, sinks,
            retrieve: int = 0) -> TierState:
    """Advance the frontier by ``block``: the block leaving the window and the tier compete; the
    ``capacity`` best stay exact, the rest go into the memory (and, with ``retrieve``, the store)."""
    B, Hkv, _, d = state.keys.shape
    Hq = state.S.shape[1]
    group = Hq // Hkv
    F0 = state.frontier
    idx = torch.arange(F0, F0 + block, device=state.keys.device)
    write = state.valid[:, :block].clone()  # (B, C): real tokens that are not sinks
    if sinks is not None:
        s_idx, s_ok = sinks[0], sinks[1]
        write &= ~((idx[None, :, None] == s_idx[:, None, :]) & s_ok[:, None, :]).any(-1)
    cand_k = torch.cat([state.tier_keys, state.read_keys[:, :, :block]], dim=2)  # (B, Hkv, cap + C, d)
    cand_v = torch.cat([state.tier_values, state.values[:, :, :block]], dim=2)
    cand_i = torch.cat([state.tier_index, idx.expand(B, Hkv, block)], dim=2)
    cand_ok = torch.cat([state.tier_index >= 0, write[:, None].expand(B, Hkv, block)], dim=2)
    if capacity:
        score = _scores(rule, cand_k, cand_v, cand_i, state.S, state.z, feature_key_weight, group)
    else:  # nothing stays: no score needed, the order only decides which slots (none) are kept
        score = cand_i.to(state.S.dtype)
    score = score.masked_fill(~cand_ok, float("-inf"))
    # the best `capacity` by score, ties to the newer token: sort by index, then stably by score
    by_index = cand_i.argsort(dim=-1, descending=True)
    order = by_index.gather(-1, score.gather(-1, by_index).argsort(dim=-1, descending=True, stable=True))
    keep, drop = order[..., :capacity], order[..., capacity:]
    keep_ok = cand_ok.gather(-1, keep)
    pick = lambda x, i: x.gather(2, i[..., None].expand(*i.shape, x.shape[-1]))  # noqa: E731
    tier_keys, tier_values = pick(cand_k, keep), pick(cand_v, keep)
    tier_index = torch.where(keep_ok, cand_i.gather(-1, keep), torch.full_like(keep, -1))
    drop_ok = cand_ok.gather(-1, drop)  # (B, Hkv, N - capacity): into the memory
    S, z, count = state.S, state.z, state.count
    if bool(drop_ok.any()):
        dk, dv = pick(cand_k, drop), pick(cand_v, drop)
        fk = hedgehog_features(_rep(dk, group), feature_key_weight).to(S.dtype)
        fk = fk * _rep(drop_ok[..., None], group).to(S.dtype)
        S = S + fk.transpose(-1, -2) @ _rep(dv, group).to(S.dtype)
        z = z + fk.sum(2)
        count = count + drop_ok.sum(-1).to(count.dtype)
    store = _stored(state, block, write) if retrieve else {}
    return replace(state, **store, keys=state.keys[:, :, block:], read_keys=state.read_keys[:, :, block:],
                   values=state.values[:, :, block:], valid=state.valid[:, block:], tier_keys=tier_keys,
                   tier_values=tier_values, tier_index=tier_index, S=S, z=z, count=count, frontier=F0 + block)


def _top_blocks(bound: torch.Tensor, k: int) -> torch.Tensor:
    """``bound``'s ``k`` largest entries along the last dim as a bool mask, ties to the lower index (older block)."""
    tau = bound.topk(k, dim=-1).values[..., -1:]
    above = bound > tau
    tied = bound == tau
    return above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """``(B, Hq, R, e) -> (B, Hkv, group R, e)``: each KV head's query heads as one run of rows (a view when
    ``x`` is contiguous), so they are scored against that head's keys without repeating the keys."""
    B, Hq, R, e = x.shape
    return x.reshape(B, Hq // group, group * R, e)


# One part of the exact keys a segment reads: scores ``(B, Hkv, gR, M)`` (scaled, soft-capped, -inf where not read)
# and a map from their weights ``p`` (same shape) to the part's outputs ``(B, Hkv, gR, D)``.
_Part = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


def _shared(values: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Outputs of keys whose values ``(B, Hkv, M, D)`` a KV head's query heads share."""
    return lambda p: p @ values.to(p.dtype)


def _per_head(values: torch.Tensor, group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Outputs of keys whose values ``(B, Hq, M, D)`` differ per query head."""
    def apply(p: torch.Tensor) -> torch.Tensor:
        B, Hkv, gR, M = p.shape
        out = p.view(B, Hkv * group, gR // group, M) @ values.to(p.dtype)
        return out.reshape(B, Hkv, gR, -1)
    return apply


def _retrieved_max(state: TierState, mqg: torch.Tensor, retrieve: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``mqg (B, Hkv, gR, d)`` scores every stored key and reads its ``retrieve`` blocks with the best
    score (ties: the older block). Returns the raw scores of the read tokens ``(B, Hkv, gR, k C)`` (-inf at tokens
    that are not real) and their stream indices ``(B, Hkv, gR, k C)``."""
    B, Hkv, gR, _ = mqg.shape
    N = state.store_keys.shape[2]
    NB = N // block
    k = min(retrieve, NB)
    s = mqg @ state.store_keys.to(mqg.dtype).transpose(-1, -2)  # (B, Hkv, gR, N): as full attention scores them
    if not bool(state.store_valid.all()):
        s.masked_fill_(~state.store_valid[:, None, None, :], float("-inf"))
    s = s.view(B, Hkv, gR, NB, block)
    chosen = _top_blocks(s.amax(-1), k)  # (B, Hkv, gR, NB), exactly k per row
    blocks = chosen.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :k]  # (B, Hkv, gR, k)
    picked = s.gather(3, blocks[..., None].expand(B, Hkv, gR, k, block)).flatten(-2)
    tokens = (blocks[..., None] * block + torch.arange(block, device=s.device)).flatten(-2)
    return picked, tokens


def _retrieved_part(state: TierState, mq: torch.Tensor, retrieve: int, block: int, by: str, scaling: float,
                    softcap: float | None) -> _Part:
    """The stored tokens that R queries ``mq (B, Hq, R, d)`` read exactly: each query's ``retrieve`` blocks ranked
    highest by ``by`` (ties: the older block)."""
    group = mq.shape[1] // state.store_keys.shape[1]
    if by == "max":  # each block's best score: every stored key scored, only the k best blocks read
        picked, tokens = _retrieved_max(state, _grouped(mq, group), retrieve, block)
        values = state.store_values

        def apply(p: torch.Tensor) -> torch.Tensor:  # the k C weights placed among the N stored values
            dense = p.new_zeros(*p.shape[:-1], values.shape[2]).scatter_(-1, tokens, p)
            return dense @ values.to(p.dtype)
        return _softcapped(picked, scaling, softcap), apply
    scores, values = _retrieved_bound(state, mq, retrieve, block)
    return _softcapped(_grouped(scores, group), scaling, softcap), _per_head(values, group)


def _retrieved_bound(state: TierState, mq: torch.Tensor, retrieve: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ranked by Quest's bound. Returns scores ``(B, Hq, R, M)`` (``mq . mk``, -inf where the query does not
    read the token) and values ``(B, Hq, M, D)``: the union of the R queries' blocks gathered (``M = U C``), or the
    whole store (``M = N``) when that union is most of it."""
    B, Hkv, NB = state.store_lo.shape[:3]
    Hq, R = mq.shape[1], mq.shape[2]
    group = Hq // Hkv
    token_ok = state.store_valid.view(B, NB, block)
    lo, hi = (_rep(x, group).to(mq.dtype) for x in (state.store_lo, state.store_hi))
    bound = mq.clamp_min(0) @ hi.transpose(-1, -2) + mq.clamp_max(0) @ lo.transpose(-1, -2)  # (B, Hq, R, NB)
    bound = bound.masked_fill(~token_ok.any(-1)[:, None, None, :], float("-inf"))
    chosen = _top_blocks(bound, min(retrieve, NB))
    union = chosen.any(2)  # (B, Hq, NB)
    U = int(union.sum(-1).max())
    if 2 * U > NB:  # most blocks: score the store as it is
        keys, values = _rep(state.store_keys, group), _rep(state.store_values, group)
        read = chosen.repeat_interleave(block, dim=-1) & state.store_valid[:, None, None, :]
    else:
        blocks = union.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :U]  # (B, Hq, U), union first
        read = chosen.gather(-1, blocks[:, :, None, :].expand(B, Hq, R, U)) & union.gather(-1, blocks)[:, :, None, :]
        ok = token_ok[:, None].expand(B, Hq, NB, block).gather(2, blocks[..., None].expand(B, Hq, U, block))
        read = (read[..., None] & ok[:, :, None]).flatten(-2)
        idx = blocks.view(B, Hkv, group, U)

        def gather(x: torch.Tensor) -> torch.Tensor:  # (B, Hkv, N, e) -> (B, Hq, U C, e), no copy of the store per head
            e = x.shape[-1]
            per_block = x.view(B, Hkv, 1, NB, block, e).expand(B, Hkv, group, NB, block, e)
            picked = per_block.gather(3, idx[..., None, None].expand(B, Hkv, group, U, block, e))
            return picked.reshape(B, Hq, U * block, e)

        keys, values = gather(state.store_keys), gather(state.store_values)
    return (mq @ keys.to(mq.dtype).transpose(-1, -2)).masked_fill(~read, float("-inf")), values


def _merged(parts: list[_Part]) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over every part's keys at once: outputs ``(B, Hkv, gR, D)`` (0 where nothing is read) and the
    log-sum-exp ``(B, Hkv, gR)`` (-inf there). Each score is exponentiated once, against its part's own maximum;
    the parts' outputs are then rescaled to the common normaliser (the maxima cancel, so they carry no gradient)."""
    maxima, sums, weights = [], [], []
    for s, _ in parts:
        m = s.detach().amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row reading nothing: its weights are 0
        p = (s - m).exp_()
        maxima.append(m[..., 0])
        sums.append(p.sum(-1))
        weights.append(p)
    logs = [torch.where(l > 0, torch.log(l.clamp_min(torch.finfo(l.dtype).tiny)), float("-inf")) for l in sums]
    lse = torch.logsumexp(torch.stack([m + log for m, log in zip(maxima, logs)]), dim=0)  # no inf gradient at 0
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    exact = sum(apply(p) * torch.exp(m - shift)[..., None] for (_, apply), p, m in zip(parts, weights, maxima))
    return exact, lse


def _segment(state: TierState, q, mq, fq, scale, count_weight, t, sinks, *, scaling, softcap, sink_distance,
             inv_freq, retrieve: int = 0, block: int = 1, retrieve_score: str = "max") -> torch.Tensor:
    """Outputs ``(B, Hq, R, D)`` of R queries at stream positions ``t`` that share one frontier.

    The exact keys come in parts (window, sinks, tier, retrieved blocks), each scored by a KV head's query heads
    together; they share one log-sum-exp without being concatenated."""
    B, Hq, R, _ = q.shape
    Hkv = state.keys.shape[1]
    group = Hq // Hkv
    acc = state.S.dtype
    W = int(t[-1]) + 1 - state.frontier  # window tokens the last query reads
    kw, vw, okw = state.keys[:, :, :W], state.values[:, :, :W], state.valid[:, :W]
    pos = torch.arange(state.frontier, state.frontier + W, device=q.device)
    qs, mqa = q.to(acc) * scaling, mq.to(acc)  # the scale folded into the R queries, not the R x M scores
    allowed = (pos[None, :] <= t[:, None])[None] & okw[:, None, :]  # (B, R, W)
    s_win = _capped_only(_grouped(qs, group) @ kw.to(acc).transpose(-1, -2), softcap)  # (B, Hkv, gR, W)
    s_win.view(B, Hkv, group, R, W).masked_fill_(~allowed[:, None, None], float("-inf"))  # no copy of the mask per head
    parts: list[_Part] = [(s_win, _shared(vw))]
    if sinks is not None and sinks[2].shape[2]:
        s_sink = _sink_scores(qs, sinks, t, state.frontier, sink_distance, inv_freq)
        parts.append((_capped_only(_grouped(s_sink, group), softcap), _shared(sinks[3])))
    if state.tier_keys.shape[2]:
        s_tier = _capped_only(_grouped(mqa * scaling, group) @ state.tier_keys.to(acc).transpose(-1, -2), softcap)
        s_tier.masked_fill_(~(state.tier_index >= 0)[:, :, None, :], float("-inf"))  # (B, Hkv, gR, cap)
        parts.append((s_tier, _shared(state.tier_values)))
    if retrieve and state.store_keys.shape[2]:
        parts.append(_retrieved_part(state, mqa, retrieve, block, retrieve_score, scaling, softcap))
    exact, lse = _merged(parts)
    finite = torch.isfinite(lse)
    exact, lse, finite = exact.reshape(B, Hq, R, -1), lse.reshape(B, Hq, R), finite.reshape(B, Hq, R)
    f = fq.to(acc)
    num = f @ state.S
    mass = (f * state.z[:, :, None]).sum(-1)
    n = _rep(state.count[..., None, None], group)[..., 0, 0]  # (B, Hq)
    c = scale.to(acc) + count_weight.to(acc)[None, :, None] * n.clamp_min(1.0).log()[..., None]
    tiny = torch.finfo(acc).tiny
    # no read where the memory is empty (mass 0) or nothing exact is read (a padded query): share 0, and no
    # infinite logit whose gradient would be NaN
    logit = torch.log(mass.clamp_min(tiny)) + c - torch.where(finite, lse, torch.zeros_like(lse))
    share = torch.where(finite & (mass > 0), torch.sigmoid(logit), torch.zeros_like(logit))
    read = num / mass.clamp_min(tiny)[..., None]
    out = exact + share[..., None] * (read - exact)
    return torch.where(finite[..., None], out, torch.zeros_like(out))


def tiered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mq: torch.Tensor,
    mk: torch.Tensor,
    fq: torch.Tensor,
    scale: torch.Tensor,
    *,
    feature_key_weight: torch.Tensor,
    count_weight: torch.Tensor,
    window: int,
    block: int,
    capacity: int,
    rule: str = "recall",
    retrieve: int = 0,
    retrieve_score: str = "max",
    scaling: float | None = None,
    softcap: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    sinks: tuple[torch.Tensor, ...] | None = None,
    sink_distance: int = 0,
    inv_freq: torch.Tensor | None = None,
    state: TierState | None = None,
) -> tuple[torch.Tensor, TierState]:
    """The three-tier attention of T new tokens (a prefill, or one decoding token), and the new state.

    Args:
        q: ``(B, Hq, T, d)`` post-RoPE queries (window and sinks); ``k``: ``(B, Hkv, T, d)`` keys; ``v``:
            ``(B, Hkv, T, D)`` values.
        mq: ``(B, Hq, T, d)`` the read's queries (scores against the tier); ``mk``: ``(B, Hkv, T, d)`` the
            read's keys (what the tier, the memory and the store hold).
        fq: ``(B, Hq, T, 2f)`` the read's query features; ``scale``: ``(B, Hq, T)`` the read's log-scale
            without its count term.
        feature_key_weight: ``(Hq, f, d)`` the key feature map (a token settling into the memory).
        count_weight: ``(Hq,)`` ``g_h``, the weight of ``log n`` in the read's log-scale.
        window: ``w``, the fewest tokens a query reads as its window; ``block``: ``C``, tokens settled
            at a time; ``capacity``: tier tokens per KV head; ``rule``: one of :data:`TIER_RULES`.
        retrieve: blocks of ``block`` settled tokens each query reads exactly, chosen per query among every
            settled block (0: none; needs ``capacity = 0``); the state then keeps every settled token.
        retrieve_score: how a query ranks the stored blocks: ``"max"`` (its best score in the block) or
            ``"bound"`` (Quest's bound from the block's key extremes).
        scaling, softcap: the pretrained scores' scale and soft-cap.
        key_padding_mask: ``(B, T)`` bool, True at real tokens (padded queries output 0, padded keys are
            never read or kept).
        sinks: ``(idx (B, n), valid (B, n), k (B, Hkv, n, d), v (B, Hkv, n, D))``, the first n real tokens
            (:func:`retrofit.ops.sinks.first_valid`); they never settle.
        sink_distance, inv_freq: sinks farther than ``sink_distance`` are scored at that RoPE distance.
        state: the tiers after the previous call (None: an empty cache).

    Returns:
        ``(out (B, Hq, T, D) in v's dtype, state)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import tiered_attention
        >>> from retrofit.ops.hedgehog import hedgehog_features
        >>> q, k, v = torch.randn(1, 4, 24, 8), torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8)
        >>> w = torch.randn(4, 3, 8)  # the feature maps: 2 x 3 features per query head
        >>> out, state = tiered_attention(q, k, v, q, k, hedgehog_features(q, w), torch.zeros(1, 4, 24),
        ...                               feature_key_weight=w, count_weight=torch.ones(4), window=8, block=4, capacity=4)
        >>> out.shape, state.length
        (torch.Size([1, 4, 24, 8]), 24)
    """
    if rule not in TIER_RULES:
        raise ValueError(f"rule must be one of {TIER_RULES}, got {rule!r}")
    if window < 1 or block < 1 or capacity < 0 or retrieve < 0:
        raise ValueError(f"window ({window}) and block ({block}) must be >= 1, capacity ({capacity}) and retrieve "
                         f"({retrieve}) >= 0")
    if retrieve_score not in RETRIEVE_SCORES:
        raise ValueError(f"retrieve_score must be one of {RETRIEVE_SCORES}, got {retrieve_score!r}")
    if retrieve and capacity:
        raise ValueError(f"block retrieval (retrieve={retrieve}) replaces the bounded tier: capacity must be 0, "
                         f"got {capacity}")
    B, Hq, T, d = q.shape
    scaling = d ** -0.5 if scaling is None else scaling
    state = _empty_state(k, v, fq, capacity) if state is None else state
    valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask.bool()
    state = replace(state, keys=torch.cat([state.keys, k], 2), read_keys=torch.cat([state.read_keys, mk], 2),
                    values=torch.cat([state.values, v], 2), valid=torch.cat([state.valid, valid], 1))
    start = state.length
    inv = None if inv_freq is None else inv_freq.to(q.device)
    outs, i = [], 0
    while i < T:
        settle_at = state.frontier + block + window - 1  # the first query that reads past this frontier
        if start + i >= settle_at:
            state = _settle(state, block, capacity, rule, feature_key_weight, sinks, retrieve)
            continue
        j = min(T, settle_at - start, i + RETRIEVAL_QUERIES if retrieve and retrieve_score == "bound" else T)
        t = torch.arange(start + i, start + j, device=q.device)
        outs.append(_segment(state, q[:, :, i:j], mq[:, :, i:j], fq[:, :, i:j], scale[:, :, i:j], count_weight, t, sinks,
                             scaling=scaling, softcap=softcap, sink_distance=sink_distance, inv_freq=inv,
                             retrieve=retrieve, block=block, retrieve_score=retrieve_score))
        i = j
    out = torch.cat(outs, dim=2) * valid[:, None, :, None]
    return out.to(v.dtype), replace(state, length=start + T)


def tiered_attention_reference(q, k, v, mq, mk, fq, scale, *, feature_key_weight, count_weight, window, block, capacity,
                               rule="recall", retrieve=0, retrieve_score="max", scaling=None, softcap=None, key_padding_mask=None,
                               num_sinks=0, sink_distance=0, inv_freq=None) -> torch.Tensor:
    """:func:`tiered_attention` of a whole sequence, query by query from the definition, in fp64.

    The tiers are built from explicit per-head sets of stream indices: for query ``t`` the exact
    keys are the sinks before ``F(t)`` (the first ``num_sinks`` real tokens), every real token in
    ``[F(t), t]``, the tier and (``retrieve``) the real non-sink tokens of the ``retrieve`` settled blocks
    whose key bound is highest for query head ``h``; the memory is the set of settled tokens not in the tier.
    """
    f64 = torch.float64
    q, k, v, mq, mk, fq, scale = (x.to(f64) for x in (q, k, v, mq, mk, fq, scale))
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scaling = d ** -0.5 if scaling is None else scaling
    valid = torch.ones(B, T, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.bool().cpu()
    weight = feature_key_weight.to(f64)
    fk = hedgehog_features(_rep(mk, group), weight)  # (B, Hq, T, F)
    inv = None if inv_freq is None else inv_freq.to(f64)
    out = torch.zeros(B, Hq, T, v.shape[-1], dtype=f64)

    @torch.no_grad()  # a selection score: the choice it makes is not differentiated
    def score_of(b: int, g: int, s: int, memory: list[int]) -> float:
        if rule == "recency":
            return float(s)
        if rule == "norm":
            return float(mk[b, g, s].norm())
        errs = []
        for h in range(g * group, (g + 1) * group):
            if memory:
                w_ = torch.stack([fk[b, h, s] @ fk[b, h, m] for m in memory])
                pred = (w_[:, None] * torch.stack([v[b, g, m] for m in memory])).sum(0) / w_.sum()
            else:
                pred = torch.zeros_like(v[b, g, s])
            errs.append(float((v[b, g, s] - pred).norm()))
        return sum(errs) / group

    for b in range(B):
        real = [s for s in range(T) if valid[b, s]]
        sink_set = set(real[:num_sinks])
        for g in range(Hkv):
            tier: list[int] = []
            memory: list[int] = []
            frontier = 0
            for t in range(T):
                while settle_frontier(t, window, block) > frontier:
                    block_ids = [s for s in range(frontier, frontier + block) if valid[b, s] and s not in sink_set]
                    scored = [(score_of(b, g, s, memory), s) for s in tier + block_ids]
                    scored.sort(key=lambda x: (x[0], x[1]), reverse=True)
                    tier = [s for _, s in scored[:capacity]]
                    memory += [s for _, s in scored[capacity:]]
                    frontier += block
                if not valid[b, t]:
                    continue
                for h in range(g * group, (g + 1) * group):
                    chosen: set[int] = set()
                    if retrieve and frontier:
                        bounds = []
                        for c0 in range(0, frontier, block):
                            members = [s for s in range(c0, c0 + block) if valid[b, s] and s not in sink_set]
                            if not members:
                                continue
                            keys_c = torch.stack([mk[b, g, s] for s in members]).detach()
                            if retrieve_score == "max":
                                bound = float((keys_c @ mq[b, h, t].detach()).max())
                            else:
                                bound = float(torch.maximum(mq[b, h, t].detach() * keys_c.amin(0),
                                                            mq[b, h, t].detach() * keys_c.amax(0)).sum())
                            bounds.append((-bound, c0, members))
                        for _, _, members in sorted(bounds, key=lambda x: (x[0], x[1]))[:retrieve]:
                            chosen.update(members)
                    logits, vals = [], []
                    for s in range(t + 1):
                        if not valid[b, s]:
                            continue
                        if s >= frontier:
                            x = q[b, h, t] @ k[b, g, s]
                        elif s in sink_set:
                            if sink_distance and inv is not None and t - s > sink_distance:
                                x = (rope_rotate(q[b, h, t], torch.tensor(float(sink_distance - t), dtype=f64), inv)
                                     @ rope_rotate(k[b, g, s], torch.tensor(float(-s), dtype=f64), inv))
                            else:
                                x = q[b, h, t] @ k[b, g, s]
                        elif s in tier:
                            x = mq[b, h, t] @ mk[b, g, s]
                        else:
                            x = None
                        if s in chosen:  # retrieved: read exactly besides the memory
                            y = mq[b, h, t] @ mk[b, g, s] * scaling
                            logits.append(torch.tanh(y / softcap) * softcap if softcap else y)
                            vals.append(v[b, g, s])
                        if x is None:
                            continue
                        x = x * scaling
                        logits.append(torch.tanh(x / softcap) * softcap if softcap else x)
                        vals.append(v[b, g, s])
                    logits_t = torch.stack(logits)
                    lse = torch.logsumexp(logits_t, 0)
                    exact = (torch.softmax(logits_t, 0)[:, None] * torch.stack(vals)).sum(0)
                    if memory:
                        w_ = torch.stack([fq[b, h, t] @ fk[b, h, m] for m in memory])
                        mass = w_.sum()
                        read = (w_[:, None] * torch.stack([v[b, g, m] for m in memory])).sum(0) / mass
                        c = scale[b, h, t] + float(count_weight[h]) * math.log(max(len(memory), 1))
                        p = torch.sigmoid(torch.log(mass) + c - lse)
                        out[b, h, t] = (1 - p) * exact + p * read
                    else:
                        out[b, h, t] = exact
    return out
