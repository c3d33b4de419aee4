"""Pretrained attention as a sliding window plus a Hedgehog linear read of the keys beyond it.

    o_t = (E_t SWA_t + e^{c(q_t)} num_t) / (E_t + e^{c(q_t)} mass_t)        then the pretrained o_proj
        = (1 - p_t) SWA_t + p_t num_t / mass_t,      p_t = sigmoid(log mass_t + c(q_t) - log E_t)

The LoLCATs-style hybrid (Zhang et al. 2024, "LoLCATs"): the frozen pretrained attention over the
last ``window`` tokens (with attention sinks: :mod:`retrofit.layers.window`'s branch), and a linear
attention in learned spiky feature maps (Hedgehog) over every older key, the two weighed in one
normalisation as the full softmax would weigh them:

* ``E_t``: the window's (and sinks') softmax mass, ``exp`` of its log-sum-exp;
* ``num_t``, ``mass_t``: the Hedgehog read of the keys ``s <= t - w`` (not sinks), unnormalised,
  and its normaliser ``sum_s phi_q(q_t) . phi_k(k_s)`` (:mod:`retrofit.ops.hedgehog`);
* ``c(q_t) = a_h . q_t + b_h + g_h log n_t`` per query head (``memory_scale``; ``n_t`` the keys in
  the memory): the log of the factor between the kernel's mass and the softmax's unnormalised mass
  beyond the window (a product of features is scaled unlike ``exp(q.k)``), so that ``p_t``
  approximates the share of the full attention beyond the window. Fitted maps and scales imitate the base without any network training
  (``retrofit fit``: :meth:`HedgehogAttention.read_kl` for the maps, :meth:`HedgehogAttention.scale_regression`
  for the scale, :mod:`retrofit.train.fit`); the transfer and weights objectives train them.

Queries and keys are the pretrained post-RoPE ones (keys repeated over their GQA group), values
the pretrained ones. The state per query head is ``(2f x D)`` plus ``2f``: constant in the length.
Decoding reads the window from the cache's in-place slots (the window branch's) with its
log-sum-exp, and moves the key leaving the window into the state (:func:`hedgehog_read_step`).

With ``memory_distance`` the read is position-free: keys rotated back to position 0 with the
cos / sin they were rotated with, queries to position ``memory_distance``. A cached key is rotated
back from the new token's position and its distance to it (the cache keeps no positions), which
assumes consecutive real tokens sit at consecutive positions, as transformers' default positions
and ``generate``'s left-padded ones do.

New weights: ``feature_query`` and ``feature_key`` (``(H, f, d)`` maps, equal at conversion, random
with std ``d^-1/2``) and ``memory_scale`` (``a_h = 0``, ``b_h = init_log_scale``, ``g_h = 0``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from retrofit.errors import RetrofitError, SpecError
from retrofit.layers.method import DEFAULT_WINDOW, MethodTestSpec, opt, register_method
from retrofit.layers.tier import DEFAULT_TIER_BLOCK, RETRIEVE_SCORES, TIER_RULES, TierLayerCache, tiered_attend
from retrofit.layers.window import WindowAttention, WindowConfig, WindowDecodingBuffers, window_config
from retrofit.ops import hedgehog_read_chunked, hedgehog_read_step, repeat_kv_heads, slot_attention_step
from retrofit.ops.hedgehog import HedgehogState, hedgehog_features
from retrofit.ops.rope import rope_at, rope_move, rope_rotate, rope_unrotate

__all__ = ["DEFAULT_HEDGEHOG_FEATURES", "DEFAULT_INIT_LOG_SCALE", "FeatureMap", "HedgehogAttention",
           "HedgehogConfig", "HedgehogDecodingBuffers", "MemoryScale", "build_hedgehog"]

# f: each map has 2 f features. 2 x 128 fitted to SmolLM2-135M's attention beyond a 1024-token window
# closes 40% of its closed twin's 4K gap at the base's share, 2 x 512 60% (BENCHMARKS.md).
DEFAULT_HEDGEHOG_FEATURES = 128
# b_h at conversion. Fitted on SmolLM2-135M (2 x 128 features, 4K text) the biases average 5.1 (per
# layer 3.4-7.0): the kernel's mass is e^5 times smaller than the softmax's. Starting lower keeps an
# untrained read (random maps) at a few percent of the share it will earn.
DEFAULT_INIT_LOG_SCALE = 2.0


@window_config("window", "features", "init_log_scale", "memory_distance", "sinks", "sink_distance", "chunk_size",
               "tier", "tier_rule", "tier_block", "retrieve", "retrieve_score")
class HedgehogConfig(WindowConfig):
    """Hyper-parameters of a window + Hedgehog linear read conversion (``retrofit convert --method hedgehog``):
    the window's (:class:`~retrofit.layers.window.WindowConfig`) and the read's."""

    method = "hedgehog"
    # attention_weights: its weights over the keys are one distribution (train.objective weights);
    # fit: `retrofit fit` fits its read to the base's attention layer by layer (retrofit.train.fit)
    capabilities = frozenset({"attention_weights", "fit"})
    # a 6-token window with 2 sinks beside a read of 2 x 8 features, in 4-token chunks
    test_spec = MethodTestSpec(options={"window": 6, "sinks": 2, "features": 8, "chunk_size": 4},
                               anchor="closed-window")
    features: int = opt(DEFAULT_HEDGEHOG_FEATURES, "f: each Hedgehog feature map has 2 f features "
                                                   "(softmax(Wx) and softmax(-Wx))")
    init_log_scale: float = opt(DEFAULT_INIT_LOG_SCALE, "initial log-factor between the read's mass and the softmax's "
                                                        "beyond the window (memory_scale's bias)")
    memory_distance: int | None = opt(None, "score every key beyond the window as if exactly this many tokens before "
                                            "its query (RoPE distance): the read then depends on no position and holds "
                                            "past the lengths it was fitted or trained on (None: true distances)")
    chunk_size: int = opt(64, "chunk length of the chunked linear read")
    tier: int = opt(0, "exact tier: tokens per KV head kept exactly, read by the pretrained softmax beside the "
                       "window, chosen among those leaving it (0 = none: every older token goes to the read)")
    tier_rule: str = opt("recall", "how the tier's tokens are chosen: recall (the read's self-recall error, LoLA), "
                                   "norm (key norm) or recency (the newest: a longer window)")
    tier_block: int = opt(DEFAULT_TIER_BLOCK, "tokens settled into the tier or the read at a time (the window then "
                                              "holds w to w + tier_block - 1 tokens)")
    retrieve: int = opt(0, "block retrieval: every settled block of tier_block tokens is kept, and each query reads "
                           "this many of them exactly, those whose keys bound its score highest (0 = off; the "
                           "cache then grows with the context; replaces the tier)")
    retrieve_score: str = opt("max", "how a query ranks the stored blocks: max (its best score in the block) or "
                                     "bound (Quest's bound from the block's key extremes: cheaper, looser)")

    def check(self) -> None:
        super().check()
        if self.tier < 0 or self.tier_block < 1:
            raise SpecError(f"tier must be >= 0 and tier_block >= 1, got {self.tier} and {self.tier_block}")
        if self.tier_rule not in TIER_RULES:
            raise SpecError(f"tier_rule must be one of {', '.join(TIER_RULES)}, got {self.tier_rule!r}")
        if self.retrieve_score not in RETRIEVE_SCORES:
            raise SpecError(f"retrieve_score must be one of {', '.join(RETRIEVE_SCORES)}, got {self.retrieve_score!r}")
        if self.retrieve < 0 or (self.retrieve and self.tier):
            raise SpecError(f"retrieve must be >= 0 and is used without a tier (tier=0), got retrieve={self.retrieve} "
                            f"and tier={self.tier}")
        if self.chunk_size < 1:
            raise SpecError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.memory_distance is not None and self.memory_distance < 0:
            raise SpecError(f"memory_distance must be >= 0 tokens (or null: true distances), got {self.memory_distance}")
        if self.features < 1:
            raise SpecError(f"features must be >= 1, got {self.features}")
        if not math.isfinite(self.init_log_scale):
            raise SpecError(f"init_log_scale must be finite, got {self.init_log_scale}")


class FeatureMap(nn.Module):
    """Hedgehog feature maps, one per head: ``(B, H, T, d) -> (B, H, T, 2 f)`` fp32; ``weight (H, f, d)``."""

    def __init__(self, heads: int, features: int, dim: int, **kw: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, features, dim, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hedgehog_features(x, self.weight)


class MemoryScale(nn.Module):
    """``c(q, n) = a_h . q + b_h + g_h log n`` per head, ``n`` the keys in the memory: ``(B, H, T, d)``
    and ``log n (B, 1 | H, T)`` ``-> (B, H, T)`` fp32; ``weight (H, d)``, ``bias (H,)``, ``count_weight (H,)``.
    ``g_h < 0`` lets the read's share grow slower than its key count (the softmax's far keys score
    lower the farther they are; a position-free read cannot see that)."""

    def __init__(self, heads: int, dim: int, **kw: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, dim, **kw))
        self.bias = nn.Parameter(torch.empty(heads, **kw))
        self.count_weight = nn.Parameter(torch.empty(heads, **kw))

    def forward(self, q: torch.Tensor, log_count: torch.Tensor) -> torch.Tensor:
        return ((q.float() @ self.weight.float()[:, :, None])[..., 0] + self.bias.float()[:, None]
                + self.count_weight.float()[:, None] * log_count.float())


@dataclass
class HedgehogDecodingBuffers(WindowDecodingBuffers):
    """The hedgehog method's compiled-decoding state (:mod:`retrofit.layers.decoding`): the window's
    slots and sinks, and the read's state, updated in place per step."""

    read_S: torch.Tensor  # (B, H, 2 f, D) the read's state (fp32 at least)
    read_z: torch.Tensor  # (B, H, 2 f) its normaliser


class _WeightTerms(NamedTuple):
    """What :meth:`HedgehogAttention._weight_terms` returns for ``R`` query rows of ``T`` keys."""

    s: torch.Tensor  # (B, Hq, R, T) fp32: the teacher's scaled scores (pairs past its RoPE cap at the cap)
    s_window: torch.Tensor  # (B, Hq, R, T): the same, the sinks scored as the layer scores them
    seen: torch.Tensor  # (B, 1, R, T) bool: the keys the teacher attends
    window: torch.Tensor  # (B, 1, R, T) bool: the window's keys and the sinks
    memory: torch.Tensor  # (B, 1, R, T) bool: the read's keys (older than the window, not sinks)
    lse: torch.Tensor  # (B, Hq, R): the window's log-sum-exp
    kappa: torch.Tensor  # (B, Hq, R, T): the read's kernel weights phi_q(q) . phi_k(k), 0 off the memory
    scale: torch.Tensor  # (B, Hq, R): the share's scale c(q, n)
    values: torch.Tensor  # (B, Hq, T, D): the values, repeated over the KV groups
    memory_query: torch.Tensor  # (B, Hq, R, d): the read's queries (position-free with memory_distance)
    log_count: torch.Tensor  # (B, R): log of the keys in the memory (at least 1)
    real_rows: torch.Tensor  # (B, R) bool: rows that are real tokens (not padding)


class HedgehogAttention(WindowAttention):
    """Pretrained attention as a ``window``-token SWA (:class:`~retrofit.layers.window.WindowAttention`) with a
    Hedgehog linear read of the older keys.

    Args:
        original: the pretrained attention module (its projections and norms move into this layer).
        patch: the family patch that builds q, k, v for it.
        window: sliding window ``w`` in tokens.
        features: ``f``; each feature map has ``2 f`` features.
        init_log_scale: ``memory_scale``'s bias at conversion.
        memory_distance: score the keys beyond the window at this RoPE distance (None: their own).
        chunk_size: chunk length of the chunked linear read.
        sinks, sink_distance: the window branch's attention sinks (:class:`~retrofit.layers.window.WindowAttention`).
        generator: seeds the feature maps.

    Returns:
        Called as ``layer(hidden_states (B, T, hidden), position_embeddings=(cos, sin),
        attention_mask=None | (B, past + T), past_key_values=None | Cache)``:
        ``(attn_output (B, T, hidden), None)``.

    Example::

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from retrofit.layers.hedgehog import HedgehogAttention
        >>> from retrofit.patches import get_patch
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> attn = HedgehogAttention(model.model.layers[0].self_attn, get_patch(model), window=8, features=16)
        >>> x = torch.randn(1, 12, 32)  # (B, T, hidden)
        >>> attn(x, position_embeddings=model.model.rotary_emb(x, torch.arange(12)[None]))[0].shape
        torch.Size([1, 12, 32])
    """

    method = "hedgehog"
    new_module_names = ("feature_query", "feature_key", "memory_scale")

    def __init__(
        self,
        original: nn.Module,
        patch: Any,
        *,
        window: int = DEFAULT_WINDOW,
        features: int = HedgehogConfig.features,
        init_log_scale: float = HedgehogConfig.init_log_scale,
        memory_distance: int | None = HedgehogConfig.memory_distance,
        chunk_size: int = HedgehogConfig.chunk_size,
        sinks: int = WindowConfig.sinks,
        sink_distance: int | None = WindowConfig.sink_distance,
        tier: int = HedgehogConfig.tier,
        tier_rule: str = HedgehogConfig.tier_rule,
        tier_block: int = HedgehogConfig.tier_block,
        retrieve: int = HedgehogConfig.retrieve,
        retrieve_score: str = HedgehogConfig.retrieve_score,
        generator: torch.Generator | None = None,
    ):
        super().__init__(original, patch, window=window, sinks=sinks, sink_distance=sink_distance)
        self.chunk_size = int(chunk_size)
        self.tier, self.tier_rule, self.tier_block = int(tier), str(tier_rule), int(tier_block)  # retrofit.layers.tier
        self.retrieve, self.retrieve_score = int(retrieve), str(retrieve_score)
        self.features = int(features)
        self.init_log_scale = float(init_log_scale)
        self.memory_distance = None if memory_distance is None else int(memory_distance)
        if self.memory_distance is not None and self.rope_inv_freq is None:
            raise ValueError("memory_distance needs the layer's rotary frequencies (a RoPE model)")
        # the fixed positions the position-free read moves its queries and a decoded key to
        self._memory_query_at = self._leaving_key_at = None
        self._rope_targets: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (name, device, dtype) -> (cos, sin)
        if self.memory_distance is not None:
            self._memory_query_at = rope_at(self.memory_distance, self.rope_inv_freq)
            self._leaving_key_at = rope_at(self.window - 1, self.rope_inv_freq)
        kw = dict(device=self._weight_ref.device, dtype=self._weight_ref.dtype)
        H, d = self.num_heads, self.head_dim
        self.feature_query = FeatureMap(H, self.features, d, **kw)
        self.feature_key = FeatureMap(H, self.features, d, **kw)
        self.memory_scale = MemoryScale(H, d, **kw)
        self.reset_new_parameters(generator)

    @torch.no_grad()
    def reset_new_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initial values described in the module docstring (``generator`` for reproducibility)."""
        w = self.feature_query.weight
        maps = torch.randn(w.shape, generator=generator) * self.head_dim ** -0.5
        self.feature_query.weight.copy_(maps)
        self.feature_key.weight.copy_(maps)
        self.memory_scale.weight.zero_()
        self.memory_scale.bias.fill_(self.init_log_scale)
        self.memory_scale.count_weight.zero_()

    def memory_writes(self, B: int, num_keys: int, valid_all, sinks, first: int, device) -> torch.Tensor:
        """``(B, num_keys)`` bool: the keys at stream positions ``first, first + 1, ...`` the memory
        stores (real tokens that are not sinks: the window's softmax keeps those)."""
        write = torch.ones(B, num_keys, dtype=torch.bool, device=device) if valid_all is None else valid_all.bool()
        if sinks is not None:
            pos = torch.arange(first, first + num_keys, device=device)
            idx, sink_valid = sinks[0], sinks[1]
            write = write & ~((idx[:, None, :] == pos[None, :, None]) & sink_valid[:, None, :]).any(-1)
        return write

    def memory_queries_and_keys(self, q, k_all, position_embeddings, num_past: int):
        """The read's queries ``(B, Hq, T, d)`` and keys ``(B, Hkv, P + T, d)``: the pretrained post-RoPE
        ones, or with ``memory_distance`` D both position-free (keys rotated back to position 0,
        queries to position D; the ``P`` cached keys from the first new token's position)."""
        if self.memory_distance is None:
            return q, k_all
        cos, sin = position_embeddings
        mq = self.memory_query(q, cos, sin)
        mk = rope_unrotate(k_all[:, :, num_past:], cos, sin)
        if num_past:
            before = rope_rotate(rope_unrotate(k_all[:, :, :num_past], cos[:, :1], sin[:, :1]),
                                 torch.arange(num_past, 0, -1, device=q.device), self.rope_inv_freq.to(q.device))
            mk = torch.cat([before, mk], dim=2)
        return mq, mk

    def memory_query(self, q, cos, sin):
        """``q (B, Hq, T, d)`` moved to RoPE position ``memory_distance``."""
        return rope_move(q, cos, sin, self._rope_target("_memory_query_at", q))

    def _rope_target(self, name: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed position's ``(cos, sin)`` (:func:`rope_at`, float64) on ``like``'s device in the
        dtype :func:`rope_move` computes in for ``like``, converted once per device and dtype."""
        dtype = torch.promote_types(like.dtype, torch.float32)
        key = (name, like.device, dtype)
        target = self._rope_targets.get(key)
        if target is None:
            target = self._rope_targets[key] = tuple(t.to(like.device, dtype) for t in getattr(self, name))
        return target

    def memory_count(self, write: torch.Tensor, num_past: int, T: int, previous: HedgehogState | None):
        """``(B, T)`` fp32: the keys in the memory each new query reads (the state's, whose every key adds
        2 to ``z``'s sum since each half of a feature vector sums to 1, plus this call's ``j <= i + P - w``)."""
        seen = F.pad(write.float().cumsum(-1), (1, 0))  # seen[n]: written keys among the first n
        upto = (torch.arange(T, device=write.device) + num_past - self.window + 1).clamp(0, write.shape[-1])
        count = seen[:, upto]
        if previous is not None:
            count = count + previous.z[:, 0].float().sum(-1, keepdim=True) / 2
        return count

    # ------------------------------------------------------------------ attention-weights distillation
    def _weight_terms(self, hidden_states, position_embeddings, attention_mask, rows, qkv=None) -> _WeightTerms:
        """The pieces of both distributions over the keys of the query rows ``rows`` ``(R,)``
        (:class:`_WeightTerms`). ``qkv``: the patch's ``project_qkv`` of ``hidden_states`` when the
        caller holds it already (:mod:`retrofit.train.fit` reuses it over many row samples).

        The teacher is the layer's :meth:`original_attention`: past ``teacher_rope_cap`` (the base's
        context) it scores a pair at the capped distance, so sequences longer than the context
        compare against the capped base, the strongest zero-shot form of the base there."""
        B, T, _ = hidden_states.shape
        H = self.num_heads
        full = not self.native_window or self.native_window >= T
        cap = self.teacher_rope_cap  # as original_attention: full attention with known frequencies only
        cap = cap if full and cap and T - 1 > cap and self.rope_inv_freq is not None else 0
        far_sinks = bool(self.sinks and self.sink_distance and T - 1 > self.sink_distance)  # the layer has inv_freq then
        if qkv is None:
            with torch.no_grad():
                qkv = self.patch.project_qkv(self, hidden_states, position_embeddings)
        q, k, v = qkv
        valid = self.key_padding(attention_mask, T)
        real = torch.ones(B, T, dtype=torch.bool, device=q.device) if valid is None else valid
        s = q[:, :, rows].float() @ repeat_kv_heads(k, H).float().transpose(-1, -2)
        i, j = rows.to(q.device)[:, None], torch.arange(T, device=q.device)[None, :]
        sink = real & (real.long().cumsum(-1) <= self.sinks)
        s_window = s
        if cap or far_sinks:  # pairs scored at a capped distance: the query moved there, the keys to position 0
            cos, sin = position_embeddings
            inv_freq = self.rope_inv_freq.to(q.device)
            q0 = rope_unrotate(q[:, :, rows], cos[:, rows], sin[:, rows]).float()
            k0 = repeat_kv_heads(rope_unrotate(k, cos, sin), H).float().transpose(-1, -2)

            def at(distance: int) -> torch.Tensor:
                return rope_rotate(q0, torch.tensor(float(distance)), inv_freq) @ k0

            if far_sinks:
                s_window = torch.where(sink[:, None, None, :] & (i - j > self.sink_distance)[None, None],
                                       at(self.sink_distance), s)
            if cap:
                s = torch.where((i - j > cap)[None, None], at(cap), s)
        s, s_window = s * self.scaling, s_window * self.scaling
        if self.softcap:
            s = torch.tanh(s / self.softcap) * self.softcap
            s_window = torch.tanh(s_window / self.softcap) * self.softcap
        causal = (j <= i)[None, None] & real[:, None, None, :]  # (B, 1, R, T)
        window = causal & ((j > i - self.window)[None, None] | sink[:, None, None, :])
        memory = causal & ~window
        seen = causal & (j > i - self.native_window)[None, None] if self.native_window else causal  # the teacher's keys
        lse = s_window.masked_fill(~window, float("-inf")).logsumexp(-1)  # (B, H, R)
        mq, mk = self.memory_queries_and_keys(q, k, position_embeddings, 0)
        mq = mq[:, :, rows]
        kappa = self.feature_query(mq) @ self.feature_key(repeat_kv_heads(mk, H)).transpose(-1, -2)
        kappa = kappa.masked_fill(~memory, 0.0)
        log_count = memory[:, 0].sum(-1).float().clamp_min(1.0).log()  # (B, R)
        scale = self.memory_scale(mq, log_count[:, None])
        return _WeightTerms(s, s_window, seen, window, memory, lse, kappa, scale, repeat_kv_heads(v, H), mq, log_count,
                            real[:, rows.to(q.device)])

    def attention_distributions(self, hidden_states: torch.Tensor, position_embeddings, attention_mask,
                                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-weights over the keys of the query rows ``rows`` ``(R,)`` (positions in the sequence):
        ``(teacher, student, values)``; ``teacher`` and ``student`` ``(B, Hq, R, T)`` fp32, ``-inf``
        where a row gives a key no weight, ``values`` ``(B, Hq, T, D)``.

        ``teacher``: the pretrained softmax (causal, or the layer's native window). ``student``: this layer's, ``(1 - p)`` times the
        window's softmax (its ``w`` last keys and the sinks) and ``p`` times the read's kernel weights
        ``phi_q(q) . phi_k(k_j) / mass`` on the older keys, so ``exp(student) @ values`` is the layer's
        output before o_proj (the test checks it). Sinks are the first ``sinks`` real tokens, scored by
        the student as the layer scores them (``sink_distance``) and by the teacher as the capped
        original attention does (:meth:`_weight_terms`)."""
        t = self._weight_terms(hidden_states, position_embeddings, attention_mask, rows)
        s, s_window, seen, window, memory, lse, kappa, scale, values = (
            t.s, t.s_window, t.seen, t.window, t.memory, t.lse, t.kappa, t.scale, t.values)
        teacher = s.masked_fill(~seen, float("-inf")).log_softmax(-1)
        mass = kappa.sum(-1)
        has = mass > 0
        logit = mass.clamp_min(1e-30).log() + scale - lse
        keep = torch.where(has, F.logsigmoid(-logit), 0.0)[..., None]  # log(1 - p)
        read = (torch.where(has, F.logsigmoid(logit), 0.0)[..., None] + kappa.clamp_min(1e-30).log()
                - mass.clamp_min(1e-30).log()[..., None])
        student = torch.where(window, keep + s_window - lse[..., None], torch.where(memory, read, float("-inf")))
        return teacher, student, values

    def attention_weights_loss(self, hidden_states, position_embeddings, attention_mask) -> torch.Tensor:
        """KL(teacher || student) of :meth:`attention_distributions` in nats per query row and head,
        averaged over ``transfer_queries`` rows spread evenly from the first one with a key beyond
        the window (and its sinks) to the last (real rows only)."""
        T = hidden_states.shape[1]
        first = min(self.window + self.sinks, T - 1)
        rows = torch.linspace(first, T - 1, self.transfer_queries).round().long().unique()
        teacher, student, _ = self.attention_distributions(hidden_states, position_embeddings, attention_mask, rows)
        weights = teacher.exp()
        kl = torch.where(weights > 0, weights * (teacher - student), 0.0).sum(-1)  # (B, H, R)
        valid = self.key_padding(attention_mask, T)
        if valid is None:
            return kl.mean()
        ok = valid[:, rows].to(kl.dtype)[:, None]
        return (kl * ok).sum() / (ok.sum() * kl.shape[1]).clamp_min(1.0)

    # ------------------------------------------------------------------ fitting the read (retrofit.train.fit)
    def read_kl(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, rows: torch.Tensor,
                qkv=None) -> torch.Tensor:
        """``(Hq,)``: KL(the pretrained softmax renormalised over the read's keys || the read's kernel
        weights ``kappa_j / sum kappa``) in nats per query row, averaged over the real rows of ``rows``
        ``(R,)`` that have keys beyond the window (LoLCATs' / Hedgehog's fit of the feature maps; the
        share is :meth:`scale_regression`'s). Gradients reach the feature maps only."""
        t = self._weight_terms(hidden_states, position_embeddings, attention_mask, rows, qkv)
        keys = t.memory & t.seen
        s = t.s.masked_fill(~keys, float("-inf"))
        lse = s.logsumexp(-1, keepdim=True)
        teacher = torch.where(keys, s - lse, 0.0)  # log-weights on the read's keys (rows without any: all off)
        mass = t.kappa.sum(-1, keepdim=True)
        student = (t.kappa.clamp_min(1e-30) / mass.clamp_min(1e-30)).log()
        kl = torch.where(keys, teacher.exp() * (teacher - student), 0.0).sum(-1)  # (B, H, R)
        ok = (keys.any(-1) & t.real_rows[:, None]).to(kl.dtype)  # (B, 1, R)
        return (kl * ok).sum((0, 2)) / ok.sum((0, 2)).clamp_min(1.0)

    @torch.no_grad()
    def scale_regression(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, rows: torch.Tensor,
                         qkv=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The least-squares problem of ``memory_scale`` on the query rows ``rows`` ``(R,)``: inputs
        ``x (B, Hq, R, d + 2)`` = ``[q_read, 1, log n]``, so that ``x @ [a_h, b_h, g_h]`` is the layer's
        ``c(q, n)``; targets ``y (B, Hq, R)`` = ``log sum_j exp(s_j) - log sum_j kappa_j`` over the keys
        beyond the window (the teacher's unnormalised mass there against the read's); ``ok (B, R)``
        the rows that count (real, with keys beyond the window and a read mass > 0). A scale that
        fits makes the share ``p_t`` the teacher's share of its attention beyond the window."""
        t = self._weight_terms(hidden_states, position_embeddings, attention_mask, rows, qkv)
        keys = t.memory & t.seen
        mass = t.kappa.sum(-1)
        y = t.s.masked_fill(~keys, float("-inf")).logsumexp(-1) - mass.clamp_min(1e-30).log()
        log_count = t.log_count[:, None, :, None].expand(-1, self.num_heads, -1, 1)
        x = torch.cat([t.memory_query.float(), torch.ones_like(log_count), log_count], dim=-1)
        ok = keys.any(-1)[:, 0] & t.real_rows & (mass > 0).all(1)
        return x, torch.where(ok[:, None], y, 0.0), ok

    @torch.no_grad()
    def set_memory_scale(self, coef: torch.Tensor) -> None:
        """Set ``c(q, n)`` from ``coef (Hq, d + 2)`` = ``[a_h, b_h, g_h]`` (:meth:`scale_regression`'s order)."""
        d = self.head_dim
        if tuple(coef.shape) != (self.num_heads, d + 2):
            raise ValueError(f"memory_scale coefficients must be ({self.num_heads}, {d + 2}), got {tuple(coef.shape)}")
        scale = self.memory_scale
        scale.weight.copy_(coef[:, :d])
        scale.bias.copy_(coef[:, d])
        scale.count_weight.copy_(coef[:, d + 1])

    def mixed_with_memory(self, swa, lse, num, mass, mq, count) -> torch.Tensor:
        """``(1 - p) SWA + p num / mass`` with ``p = sigmoid(log mass + c(q, n) - lse)`` (0 where the
        memory is empty): ``(B, Hq, T, D)`` in ``swa``'s dtype."""
        has = mass > 0
        scale = self.memory_scale(mq, count.clamp_min(1.0).log()[:, None])
        share = torch.where(has, torch.sigmoid(mass.clamp_min(1e-30).log() + scale - lse), 0.0)
        read = num / torch.where(has, mass, 1.0)[..., None]
        return swa + (share[..., None] * (read - swa.float())).to(swa.dtype)

    def check_cache_has_memory(self, cache, previous: HedgehogState | None) -> None:
        if cache is not None and cache.cumulative_length and previous is None and not self.latent_path_closed:
            raise RuntimeError("this cache was filled with the read closed (latent_path_closed), so it holds no "
                               "memory of the keys before: start a new cache to decode with the read open")

    def new_cache_layer(self):
        return TierLayerCache() if self.exact_tokens else super().new_cache_layer()

    @property
    def exact_tokens(self) -> bool:
        """Whether the layer reads older tokens exactly beside its read (a tier or block retrieval)."""
        return bool(self.tier or self.retrieve)

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        B, H, T, _ = q.shape
        if self.exact_tokens and not self.latent_path_closed:
            if cache is not None and not isinstance(cache, TierLayerCache):
                raise RuntimeError("this cache was filled without the exact tier: start a new cache after set_tier")
            return tiered_attend(self, q, k, v, valid, cache, position_embeddings)
        previous: HedgehogState | None = cache.state if cache is not None else None
        self.check_cache_has_memory(cache, previous)
        if self._takes_slot_step(T, cache):
            return self._memory_slot_step(q, k, v, valid, cache, position_embeddings)
        k_all, v_all, valid_all, num_past, sinks, seen, far = self.window_inputs(q, k, v, valid, cache)
        out, lse = self.window_with_lse(q, k_all, v_all, valid_all, num_past, sinks, seen, far)
        state = None
        if not self.latent_path_closed:
            first = (cache.cumulative_length if cache is not None else 0) - num_past  # stream position of k_all[0]
            Tk = k_all.shape[2]
            stored = max(min(T + num_past - self.window + 1, Tk), 0)  # keys a query (or the state) takes here
            mq, mk = self.memory_queries_and_keys(q, k_all, position_embeddings, num_past)
            fq = self.feature_query(mq)
            fk = self.feature_key(repeat_kv_heads(mk[:, :, :stored], H))
            fk = F.pad(fk, (0, 0, 0, Tk - stored))  # later keys stay in the window for this whole call
            write = self.memory_writes(B, Tk, valid_all, sinks, first, q.device)
            num, mass, state = hedgehog_read_chunked(
                fq, fk, repeat_kv_heads(v_all, H), write, window=self.window, num_past=num_past,
                initial_state=previous, output_final_state=cache is not None, chunk_size=self.chunk_size,
            )
            out = self.mixed_with_memory(out, lse, num, mass, mq, self.memory_count(write, num_past, T, previous))
            if valid_all is not None:  # padded queries output 0, as the window kernels do
                out = torch.where(valid_all[:, None, -T:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        if cache is not None:
            cache.store(k_all, v_all, valid_all, state, T, sinks=sinks)
        return out

    def memory_step(self, q, k_old, v_old, write, state: HedgehogState | None, position_embeddings, swa, lse):
        """One decoding token's read and state update, after its window: ``q (B, Hq, 1, d)`` reads the
        state (the keys ``s <= t - w``), which then takes the post-RoPE key ``k_old (B, Hkv, 1, d)``
        (value ``v_old``) of token ``t - w + 1`` where ``write (B, 1)``. ``swa`` ``(B, Hq, 1, D)`` and
        ``lse`` ``(B, Hq, 1)``: the window's attention and log-sum-exp. Returns ``(out, state)``."""
        H = q.shape[1]
        mq = q
        if self.memory_distance is not None:
            cos, sin = position_embeddings
            mq = self.memory_query(q, cos, sin)
            # the key sits w - 1 positions before the query (consecutive real tokens): moving it from the
            # query's rotation to w - 1's puts it at position 0
            k_old = rope_move(k_old, cos, sin, self._rope_target("_leaving_key_at", k_old))
        count = (state.z[:, 0].sum(-1, keepdim=True) / 2) if state is not None else q.new_zeros(q.shape[0], 1)
        num, mass, state = hedgehog_read_step(self.feature_query(mq), self.feature_key(repeat_kv_heads(k_old, H)),
                                              repeat_kv_heads(v_old, H), write, state)
        return self.mixed_with_memory(swa, lse, num, mass, mq, count), state

    def _memory_slot_step(self, q, k, v, valid, cache, position_embeddings) -> torch.Tensor:
        """One decoding token: the window through the cache's slots (:meth:`slot_window`) with its
        log-sum-exp, the read of the state, and the key leaving the window written into the state:
        ``(B, Hq, 1, D)``."""
        out, lse = self.slot_window_step(q, k, v, valid, cache)
        t = cache.cumulative_length  # this token's stream index
        n = cache.sink_slots
        state = cache.state
        if not self.latent_path_closed:
            # the oldest token of this query's window, t - w + 1, is in no later window: the state takes it
            # (once the ring is full it sits in the slot the next token overwrites; before, no token
            # leaves and that slot, past the filled ones, is read from the whole ring and not written)
            i = n + cache.slot_next
            write = cache.slot_allowed[:, i : i + 1] & (cache.slot_filled == self.window)
            if cache.sinks is not None:
                idx, sink_ok = cache.sinks[0], cache.sinks[1]
                write = write & ~((idx == t - self.window + 1) & sink_ok).any(-1, keepdim=True)
            out, state = self.memory_step(q, cache.slot_keys[:, :, i : i + 1], cache.slot_values[:, :, i : i + 1],
                                          write, state, position_embeddings, out, lse)
        if valid is not None:  # a padded query outputs 0 (it may see no slot at all)
            out = torch.where(valid[:, None, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        cache.advance(state)
        return out

    # ------------------------------------------------------------------ compiled decoding (retrofit.layers.decoding)
    def compiled_decoding_support(self) -> str | None:
        """None unless the layer reads older tokens exactly (an exact tier or block retrieval: no compiled step)."""
        if self.exact_tokens:
            return "compiled decoding has no step for an exact tier or block retrieval; decode eagerly"
        return None

    def init_decoding_buffers(self, entry: Any) -> HedgehogDecodingBuffers:
        """The window's buffers (:meth:`window_decoding_buffers`) and the read's state ``S (B, H, 2 f, D)``,
        ``z (B, H, 2 f)`` (fp32 at least; zeros before any key left the window), copied from the
        prefill's cache ``entry``. A prefill run with the read closed kept no state: refused while the
        read is open."""
        window = self.window_decoding_buffers(entry)
        state: HedgehogState | None = entry.state
        if state is None and not self.latent_path_closed:
            raise RetrofitError("the prompt was run with the Hedgehog read closed, so the cache holds no memory of its "
                                "keys: prefill again with the read open")
        B, D = window.slot_v.shape[0], window.slot_v.shape[-1]
        features = 2 * self.features
        read_S = state.S.clone() if state is not None else torch.zeros(
            B, self.num_heads, features, D, dtype=torch.promote_types(window.slot_v.dtype, torch.float32),
            device=window.slot_k.device)
        read_z = state.z.clone() if state is not None else read_S.new_zeros(B, self.num_heads, features)
        return HedgehogDecodingBuffers(**window.window_fields(), read_S=read_S, read_z=read_z)

    def decoding_step(self, buffers: HedgehogDecodingBuffers, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      hidden_states: torch.Tensor, position_embeddings: Any, position: torch.Tensor) -> torch.Tensor:
        """The eager slot step's arithmetic (:meth:`_memory_slot_step`) over the fixed buffers: the window
        through its slots (:meth:`decoding_window`) with its log-sum-exp, the read of the state, and
        the key leaving the window (token ``t - w + 1``, in ring slot ``(t + 1) % w``, unless a sink)
        written into it (:meth:`memory_step`): ``q (B, Hq, 1, d)``, ``k``, ``v`` ``(B, Hkv, 1, .)`` ->
        ``(B, Hq, 1, D)``; the read's state copied back into ``buffers``."""
        t = position
        allowed = self.decoding_window(buffers, k, v, t)
        out, lse = slot_attention_step(q, buffers.slot_k, buffers.slot_v, allowed, scaling=self.scaling, with_lse=True)
        if self.latent_path_closed:
            return out
        n, w = buffers.sink_k.shape[2], self.window
        leaving = t - w + 1  # the oldest token of this query's window: no later window holds it
        slot = (n + (t + 1) % w).view(1)
        write = (leaving >= 0).view(1, 1).expand(q.shape[0], 1)
        if n:
            write = write & ~((buffers.sink_idx == leaving) & buffers.sink_ok).any(-1, keepdim=True)
        out, state = self.memory_step(q, buffers.slot_k.index_select(2, slot), buffers.slot_v.index_select(2, slot),
                                      write, HedgehogState(buffers.read_S, buffers.read_z), position_embeddings, out,
                                      lse)
        buffers.read_S.copy_(state.S)
        buffers.read_z.copy_(state.z)
        return out

    def _options_repr(self) -> str:
        return (f", features={self.features}, init_log_scale={self.init_log_scale}"
                + (f", memory_distance={self.memory_distance}" if self.memory_distance is not None else "")
                + (f", tier={self.tier} ({self.tier_rule}, block {self.tier_block})" if self.tier else "")
                + (f", retrieve={self.retrieve} blocks of {self.tier_block} ({self.retrieve_score})"
                   if self.retrieve else ""))


def build_hedgehog(original: nn.Module, patch: Any, spec: Any, layer_idx: int,
                   generator: torch.Generator | None) -> HedgehogAttention:
    """Method-registry builder: a :class:`HedgehogAttention` from ``spec.config`` (resolved window)."""
    c: HedgehogConfig = spec.config
    return HedgehogAttention(
        original, patch, window=c.window if c.window is not None else DEFAULT_WINDOW, features=c.features,
        init_log_scale=c.init_log_scale, memory_distance=c.memory_distance, chunk_size=c.chunk_size, sinks=c.sinks,
        sink_distance=c.sink_distance, tier=c.tier, tier_rule=c.tier_rule, tier_block=c.tier_block, retrieve=c.retrieve,
        retrieve_score=c.retrieve_score,
        generator=generator,
    )


register_method(
    "hedgehog", build_hedgehog, config=HedgehogConfig,
    description="pretrained attention as a w-token sliding window + a Hedgehog linear read of the keys beyond it",
)
