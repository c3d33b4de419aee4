"""LAVO (Linear Attention Via Orthogonal memory) as a drop-in replacement for a pretrained
attention module (``--method lavo``)::

    local_t  = pretrained attention over the last w tokens + relative position bias
    global_t = softmax_i(c * H_{t,i} (q~_t . b_i)) weighted sum of H_{t,i} b_i,
               H_t = mean of B local_s over the complete w-windows before t's own
    o_t      = (1 - g) local_t + g global_t      (tokens of the first window: local_t)
    then the pretrained o_proj

Choices the paper (``retrofit.ops.lavo``) leaves open, made here for a retrofit:

* **Local branch** = the pretrained attention (q/k/v, q/k norms, RoPE, scaling, Gemma 2
  soft-capping) restricted to ``window`` tokens, plus the paper's relative position bias
  ``rel_bias`` ``(Hq, w)`` (one value per query head and distance), initialised to 0 so the
  branch starts as exactly the pretrained sliding-window attention. RoPE stays: removing it
  (as the paper does for GPT-2's absolute embeddings) would break the pretrained weights.
* **Global branch** = new bases ``B`` ``(Hq, r, d)`` per query head, each head's rows
  orthonormal at conversion (Saxe et al. orthogonal init; the paper then trains them freely,
  so does this). Memory inputs are the local outputs (paper: "local attention on the tokens
  in each window before compressing"), which live in value space, so ``global_t`` lands where
  ``o_proj`` expects. Context dissection: only complete windows before the query's own window
  are in the memory (the window itself is the local branch's).
* **Global query** q~ = the pretrained query *before* RoPE (after the q norm): the memory has
  no positions, and a rotated query would see the bases turn with t. It is recovered by
  rotating the RoPE'd query back (``rotary_fn(q, k, cos, -sin)``), so the family patch stays
  the single place that knows how q is built.
* **Read temperature** ``c`` = the pretrained attention scaling (``memory_scaling`` option to
  override; the paper's eq. 4 has none, but its q is not a pretrained one).
* **Combination**: the paper averages (g = 1/2). Here g = sigmoid(gate) per query head,
  initialised at ``global_weight`` (default 1/2, the paper) and trainable unless
  ``learn_global_weight`` is off. ``global_weight = 0`` (fixed) with the zero bias is exactly
  the pretrained model with a w-token sliding window: a testable anchor, also reachable on a
  trained layer by setting ``latent_path_closed = True`` (g = 0, bias off; what
  ``retrofit.surgery.probe.closed_latent_path`` does).
  Measured at conversion on Gemma 3 270M (w = 128, all layers, 2048 tokens of Moby-Dick,
  NLL/token; base 3.296): g = 0 / 0.05 / 0.1 / 0.25 / 0.5 give 4.408 / 4.408 / 4.407 / 4.406 /
  4.401, so the untrained memory never hurts there and the paper's 1/2 is the default.
  Caveat: Gemma 2/3 RMS-normalise the attention output (post-attention norm), which hides the
  (1 - g) shrink of the local branch; LLaMA-shaped families have no such norm and start with
  the local output scaled by (1 - g): lower ``global_weight`` there if the step-0 loss matters.

New weights (trainable after conversion): ``lavo.bases``, ``lavo.rel_bias``, ``lavo.gate``.
Decoding keeps the last ``w - 1`` keys/values and a :class:`~retrofit.ops.lavo.LavoState`
(sums of ``B x`` and token counts): memory constant in the context length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retrofit.errors import SpecError

from retrofit.layers.cache import RetrofitLayerCache
from retrofit.layers.base import RetrofitAttention
from retrofit.layers.method import DEFAULT_WINDOW, MethodTestSpec, opt, register_method
from retrofit.layers.window import WindowSizeConfig
from retrofit.ops import lavo_attention

__all__ = ["LavoAttention", "LavoConfig", "LavoLayerCache", "LavoParameters", "build_lavo"]

DEFAULT_BASES = 64  # the paper's num_bases for language modelling (Table 1); capped at head_dim


@dataclass
class LavoConfig(WindowSizeConfig):
    """Hyper-parameters of a LAVO conversion (``retrofit convert --method lavo``): the local window's
    size (:class:`~retrofit.layers.window.WindowSizeConfig`; no sinks) and the memory's."""

    method = "lavo"
    # a 6-token window (its memory holds the complete windows before it) with 8 bases per head
    test_spec = MethodTestSpec(options={"window": 6, "bases": 8, "global_weight": 0.3}, anchor="closed-window")
    bases: int | None = opt(None, f"orthonormal bases r per head (default min({DEFAULT_BASES}, head_dim))")
    global_weight: float = opt(0.5, "initial g of out = (1-g) local + g global (the paper averages: 0.5)")
    learn_global_weight: bool = opt(True, "train g (off: g stays fixed)")
    relative_bias: bool = opt(True, "the paper's relative position bias on the local branch")
    dissect: bool = opt(True, "memory of the complete windows before the query's own (paper 3.2); off = eq. 4")
    memory_scaling: float | None = opt(None, "read temperature of the memory (default: the pretrained scaling)")

    def check(self) -> None:
        super().check()
        if self.bases is not None and self.bases < 1:
            raise SpecError(f"bases must be >= 1, got {self.bases}")
        g = self.global_weight
        if not 0.0 <= g < 1.0 or (self.learn_global_weight and g == 0.0):
            raise SpecError(f"global_weight={g}: use 0 < g < 1 (0.5 = the paper's average); "
                            "g = 0 only with learn_global_weight=false (the sliding-window anchor)")


class LavoParameters(nn.Module):
    """The new weights of one LAVO layer: bases ``(Hq, r, d)``, rel_bias ``(Hq, w)``, gate ``(Hq,)``.

    Args:
        heads: query heads ``Hq``.
        bases: orthonormal bases ``r`` per head (``r <= head_dim``).
        head_dim: ``d``.
        window: local window ``w`` (the relative bias has one value per distance).
        relative_bias: keep ``rel_bias`` (off: None).
        learn_gate: the gate is a parameter (off: a buffer).

    Returns:
        Holds weights only (no forward); :meth:`global_weight` gives ``g = sigmoid(gate)`` ``(Hq,)`` in fp32.

    Example::

        >>> from retrofit.layers.lavo import LavoParameters
        >>> p = LavoParameters(heads=4, bases=8, head_dim=16, window=32, relative_bias=True, learn_gate=True)
        >>> p.reset_parameters(global_weight=0.5)
        >>> p.bases.shape, p.rel_bias.shape, p.global_weight().tolist()
        (torch.Size([4, 8, 16]), torch.Size([4, 32]), [0.5, 0.5, 0.5, 0.5])
    """

    def __init__(self, heads: int, bases: int, head_dim: int, window: int, *, relative_bias: bool, learn_gate: bool, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.bases = nn.Parameter(torch.empty(heads, bases, head_dim, **kw))
        self.rel_bias = nn.Parameter(torch.zeros(heads, window, **kw)) if relative_bias else None
        gate = torch.zeros(heads, **kw)
        if learn_gate:
            self.gate = nn.Parameter(gate)
        else:
            self.register_buffer("gate", gate)

    @torch.no_grad()
    def reset_parameters(self, global_weight: float, generator: torch.Generator | None = None) -> None:
        for h in range(self.bases.shape[0]):
            w = torch.empty(self.bases.shape[1:], dtype=torch.float32)
            nn.init.orthogonal_(w, generator=generator)
            self.bases[h].copy_(w)
        if self.rel_bias is not None:
            self.rel_bias.zero_()
        self.gate.fill_(_logit(global_weight))

    def global_weight(self) -> torch.Tensor:
        """g per query head ``(Hq,)`` in fp32."""
        return torch.sigmoid(self.gate.float())


def _logit(p: float) -> float:
    if p <= 0.0:
        return -math.inf  # only reachable with a fixed gate: sigmoid(-inf) = 0 exactly
    if p >= 1.0:
        return math.inf
    return math.log(p / (1.0 - p))


class LavoLayerCache(RetrofitLayerCache):
    """LAVO's decoding-cache entry: the generic rolling window of the last ``w - 1`` keys/values
    and, as its state, the orthogonal memory's :class:`~retrofit.ops.LavoState` (``committed`` /
    ``pending`` ``(B, Hq, r)``, counts ``(B,)``); nothing beyond the generic fields.

    Args:
        window: the local window ``w`` in tokens.

    Example::

        >>> import torch, retrofit
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> model = retrofit.convert(model, retrofit.ConversionSpec(method="lavo", window=4, bases=8))
        >>> from retrofit.layers.cache import output_cache
        >>> out = model(torch.randint(0, 64, (1, 10)), use_cache=True)  # its DynamicCache adopts the entry
        >>> entry = output_cache(out).layers[0]
        >>> type(entry).__name__, entry.buffered, entry.state.committed.shape  # w - 1 keys; (B, Hq, r)
        ('LavoLayerCache', 3, torch.Size([1, 4, 8]))
    """


class LavoAttention(RetrofitAttention):
    """Pretrained attention as LAVO's local branch + a new orthogonal-memory global branch.

    Args:
        original: the pretrained attention module (its projections and norms move into this layer).
        patch: the family patch (:func:`retrofit.patches.get_patch`) that builds q, k, v for it.
        window: local window ``w`` in tokens.
        bases: orthonormal bases ``r`` per query head, ``1 <= r <= head_dim`` (None: min(64, head_dim)).
        global_weight: initial ``g`` of ``(1 - g) local + g global``, in [0, 1) (0 only with a fixed gate).
        learn_global_weight: train ``g`` (off: a fixed buffer).
        relative_bias: the relative position bias ``(Hq, w)`` on the local branch.
        dissect: memory of the complete windows before the query's own (off: every past token).
        memory_scaling: read temperature of the memory (None: the pretrained scaling).
        generator: seeds the orthogonal bases.

    Returns:
        Called like every converted layer (:meth:`RetrofitAttention.forward`), ``(B, T, hidden)``
        hidden states in, ``(attn_output (B, T, hidden), None)`` out.

    Example::

        >>> import retrofit
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from retrofit.layers import LavoAttention
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> model = retrofit.convert(model, retrofit.ConversionSpec(method="lavo", window=4, bases=8))
        >>> attn = model.model.layers[0].self_attn
        >>> lavo = attn.lavo if isinstance(attn, LavoAttention) else None  # its new weights
        >>> lavo.bases.shape, lavo.rel_bias.shape, lavo.global_weight().tolist()  # (Hq, r, d), (Hq, w), g
        (torch.Size([4, 8, 8]), torch.Size([4, 4]), [0.5, 0.5, 0.5, 0.5])
    """

    method = "lavo"
    new_module_names = ("lavo",)
    # True: g = 0 and no bias, i.e. the pretrained attention in the window (the probe's SWA anchor)
    latent_path_closed: bool = False

    def __init__(
        self,
        original: nn.Module,
        patch: Any,
        *,
        window: int = DEFAULT_WINDOW,
        bases: int | None = LavoConfig.bases,
        global_weight: float = LavoConfig.global_weight,
        learn_global_weight: bool = LavoConfig.learn_global_weight,
        relative_bias: bool = LavoConfig.relative_bias,
        dissect: bool = LavoConfig.dissect,
        memory_scaling: float | None = LavoConfig.memory_scaling,
        generator: torch.Generator | None = None,
    ):
        super().__init__(original, patch)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        r = min(DEFAULT_BASES, self.head_dim) if bases is None else int(bases)
        if not 1 <= r <= self.head_dim:
            raise ValueError(
                f"bases={r}: LAVO needs 1 <= bases <= head_dim ({self.head_dim}) orthogonal vectors per head"
            )
        global_weight = float(global_weight)
        if not 0.0 <= global_weight < 1.0 or (learn_global_weight and global_weight == 0.0):
            raise ValueError(
                f"global_weight={global_weight}: use 0 < g < 1 (0.5 = the paper's average); "
                "g = 0 only with learn_global_weight=false (the sliding-window anchor)"
            )
        self.window = int(window)
        self.num_bases = r
        self.init_global_weight = global_weight
        self.dissect = bool(dissect)
        self.memory_scaling = float(self.scaling if memory_scaling is None else memory_scaling)
        ref = self._weight_ref
        self.lavo = LavoParameters(
            self.num_heads, r, self.head_dim, self.window, relative_bias=relative_bias,
            learn_gate=learn_global_weight, device=ref.device, dtype=ref.dtype,
        )
        self.lavo.reset_parameters(global_weight, generator)

    def new_cache_layer(self) -> LavoLayerCache:
        return LavoLayerCache(window=self.window)

    def global_query(self, q: torch.Tensor, k: torch.Tensor, position_embeddings) -> torch.Tensor:
        """The query before RoPE ``(B, Hq, T, d)``: the rotation undone (cos, -sin)."""
        cos, sin = position_embeddings
        return self.patch.rotary_fn(q, k, cos, -sin)[0]

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        T = q.shape[2]
        qg = self.global_query(q, k, position_embeddings)
        params = self.lavo
        closed = self.latent_path_closed
        kw = dict(
            window=self.window, rel_bias=None if closed else params.rel_bias, global_query=qg,
            global_weight=0.0 if closed else params.global_weight(),
            dissect=self.dissect, scaling=self.scaling, memory_scaling=self.memory_scaling, softcap=self.softcap,
        )
        if cache is None:
            out, _ = lavo_attention(q, k, v, params.bases, key_padding_mask=valid, **kw)
            return out

        k_all, v_all, valid_all, num_past = cache.with_past(k, v, valid)
        out, state = lavo_attention(
            q, k_all, v_all, params.bases, key_padding_mask=valid_all, num_past=num_past,
            initial_state=cache.state, output_final_state=True, **kw,
        )
        cache.store(k_all, v_all, valid_all, state, T)
        return out

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, window={self.window}, bases={self.num_bases}, "
            f"global_weight={self.init_global_weight}, dissect={self.dissect}, "
            f"relative_bias={self.lavo.rel_bias is not None}"
        )


# ---------------------------------------------------------------------- method registration
def build_lavo(original: nn.Module, patch: Any, spec: Any, layer_idx: int, generator: torch.Generator | None) -> LavoAttention:
    """Method-registry builder: a :class:`LavoAttention` from ``spec.config`` (resolved window)."""
    c: LavoConfig = spec.config
    return LavoAttention(
        original, patch, **c.window_options(), bases=c.bases,
        global_weight=c.global_weight, learn_global_weight=c.learn_global_weight, relative_bias=c.relative_bias,
        dissect=c.dissect, memory_scaling=c.memory_scaling, generator=generator,
    )


register_method(
    "lavo", build_lavo, config=LavoConfig,
    description="LAVO: pretrained attention in a w-token window + trainable orthogonal memory of the past windows",
)
