"""Common base of the modules that replace a pretrained attention module.

A replacement keeps the pretrained submodules under the SAME attribute names (``q_proj``,
``k_proj``, ``v_proj`` or a fused ``qkv_proj``, ``o_proj``, ``q_norm``, ``k_norm``, ...): the
objects are moved, not copied, so pretrained state-dict keys are unchanged and weights stay
shared. The family ``patch`` (``retrofit.patches``; passed in, not imported, to keep the arrows one way) is what
knows how to turn hidden states into q, k, v for that family.

Forward contract (what transformers 5.x decoder layers call)::

    forward(hidden_states (B, T, hidden), position_embeddings=(cos, sin), attention_mask=None,
            past_key_values=None, **kwargs) -> (attn_output (B, T, hidden), None)

:meth:`RetrofitAttention.forward` is written once here: the family's q, k, v, the new tokens'
padding flags and the layer's cache entry, then the method's :meth:`~RetrofitAttention.attend`
(the only part a method writes), then the pretrained output projection.

``attention_mask`` is what the ``"retrofit"`` mask function produces: ``None`` (no padding) or
the 2D bool key padding mask ``(B, past + T)``; a converted layer never needs a T x T mask.
Packed documents reach the layer as transformers' packed format, ``position_ids`` (a keyword
the decoder layers pass on) that restart at each document: without a padding mask and without
a cache, such a call runs one document per row (:mod:`retrofit.layers.documents`), so no
window or linear state crosses a document boundary, in every mode below.

Distillation modes (``distill_mode``, set through :func:`retrofit.surgery.distill.distill_mode`):
the frozen pretrained projections are still here, so the layer can also compute the attention it
replaced, :meth:`original_attention` (full causal softmax, or the layer's native window):

* ``None``: the method's own forward (inference, LM training);
* ``"teacher"``: the original attention only; a model whose layers are all teachers is the base;
* ``"transfer"``: both; the layer hands the *teacher's* output downstream (every layer learns
  from the original model's hidden states, as in LoLCATs' attention transfer) and keeps
  ``transfer_loss``: the mean squared error of its output against the teacher's after o_proj
  (the error the residual stream actually receives), divided by the teacher output's mean
  square, so every layer's term is a relative error whatever the scale of its o_proj
  (positions weighted by ``transfer_position_weights`` ``(B, T)`` when set, e.g. recall answers);
* ``"weights"``: as ``"transfer"`` (the teacher's output downstream), but ``transfer_loss`` is
  :meth:`~RetrofitAttention.attention_weights_loss`: the KL divergence from the pretrained
  softmax's attention weights to the layer's own, for methods whose output is an explicit
  distribution over the keys (``capabilities`` ``"attention_weights"``; Hedgehog's objective).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from retrofit.layers.cache import RetrofitLayerCache, layer_cache
from retrofit.layers.documents import DocumentBatch, packed_documents
from retrofit.layers.method import registered_method
from retrofit.ops import capped_rope_attention, gqa_sdpa, sliding_window_attention

__all__ = ["DEFAULT_TRANSFER_QUERIES", "DISTILL_MODES", "RetrofitAttention", "adapters_off"]

DISTILL_MODES = (None, "teacher", "transfer", "weights")
# query rows per sequence whose attention weights the "weights" mode compares (a (B, H, R, T) score block)
DEFAULT_TRANSFER_QUERIES = 64


@contextlib.contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """Inside, every PEFT adapter under ``module`` (LoRA layers, ``modules_to_save`` copies) is
    bypassed, so the pretrained weights alone compute: the teacher of a distillation objective is
    the model as it was before training, whatever adapters train on its projections.

    Duck-typed on PEFT's ``enable_adapters(bool)`` / ``disable_adapters`` (the layers tier never
    imports peft); every parameter's ``requires_grad`` and each adapter's on/off state are restored
    on exit. A module without adapters passes through unchanged.
    """
    tuners = [m for m in module.modules()
              if callable(getattr(m, "enable_adapters", None)) and hasattr(m, "disable_adapters")]
    was_off = [bool(m.disable_adapters) for m in tuners]
    if all(was_off):
        yield
        return
    grads = [(p, p.requires_grad) for m in tuners for p in m.parameters()]
    for m, off in zip(tuners, was_off):
        if not off:
            m.enable_adapters(False)
    try:
        yield
    finally:
        for m, off in zip(tuners, was_off):
            if not off:
                m.enable_adapters(True)
        for p, flag in grads:
            p.requires_grad_(flag)


def _split_pair(docs: DocumentBatch, pair: tuple[torch.Tensor, torch.Tensor] | None):
    """``(cos, sin)`` ``(B or 1, T, d)`` each -> the per-document ``(N, L, d)`` pair (None stays None)."""
    return None if pair is None else tuple(docs.split(t) for t in pair)


class RetrofitAttention(nn.Module):
    """Holds the pretrained projections of one attention layer plus a method's new weights.

    A method subclasses it and writes :meth:`attend` (and, when it keeps more than a recurrent
    state and a key window, :meth:`new_cache_layer`); :meth:`forward` is shared.

    Args:
        original: the pretrained attention module; the submodules the patch names (``q_proj``,
            ``k_proj``, ``v_proj`` or ``qkv_proj``, ``o_proj``, q/k norms) move into this layer.
        patch: the family patch (:func:`retrofit.patches.get_patch`): q, k, v and the output
            projection for that family, its scaling, soft-cap and native window.

    Returns:
        Called as ``layer(hidden_states (B, T, hidden), position_embeddings=(cos, sin),
        attention_mask=None | (B, past + T), past_key_values=None | Cache)``:
        ``(attn_output (B, T, hidden), None)``.

    Example::

        >>> import torch, retrofit
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from retrofit.layers import RetrofitAttention
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
        >>> attn = retrofit.convert(model, retrofit.ConversionSpec(method="llp", segment=8)).model.layers[0].self_attn
        >>> isinstance(attn, RetrofitAttention), attn.method, attn.new_parameter_names()
        (True, 'llp', [])
        >>> x = torch.randn(1, 12, 32)  # the attention it replaced, for distillation: (B, T, hidden)
        >>> attn.original_attention(x, model.model.rotary_emb(x, torch.arange(12)[None])).shape
        torch.Size([1, 12, 32])
    """

    is_retrofit_attention = True
    method: str = ""
    new_module_names: tuple[str, ...] = ()  # children holding new (trainable) weights

    def __init__(self, original: nn.Module, patch: Any):
        super().__init__()
        self.patch = patch
        self.layer_idx = int(original.layer_idx)
        self.config = original.config
        self.head_dim = patch.head_dim(original)
        self.num_heads, self.num_kv_heads = patch.num_heads(original)
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = patch.scaling(original)
        self.softcap = patch.softcap(original)
        self.native_window = patch.native_window(original)
        self.hidden_size = int(self.config.hidden_size)
        self.is_causal = True
        self.original_class = type(original).__name__
        for name, child in patch.submodules(original):
            self.add_module(name, child)
        self.distill_mode: str | None = None
        self.transfer_loss: torch.Tensor | None = None
        self.transfer_position_weights: torch.Tensor | None = None  # (B, T) weights of transfer_loss's positions
        self.transfer_queries = DEFAULT_TRANSFER_QUERIES  # query rows per sequence of the "weights" mode
        # the layer's RoPE frequencies, fp32 and kept off the buffers (model.to(bf16) cannot round
        # them); None for a RoPE type whose frequencies follow the sequence
        self.rope_inv_freq = patch.rope_inv_freq(original)
        self.teacher_rope_cap = 0  # original_attention's RoPE distance cap: convert sets the spec's rope_cap

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Args:
            hidden_states: ``(B, T, hidden)``.
            position_embeddings: ``(cos, sin)`` from the decoder's rotary embedding, ``(B, T, rotary_dim)`` each.
            attention_mask: None or the 2D key padding mask ``(B, past + T)`` (the ``"retrofit"`` mask).
            past_key_values: a transformers ``Cache`` (decoding) or None.
            position_ids (keyword): ``(B or 1, T)``; where they restart inside a row (packed
                documents) each document is attended alone (:mod:`retrofit.layers.documents`).

        Returns:
            ``(attn_output (B, T, hidden), None)``.
        """
        docs = packed_documents(kwargs.get("position_ids"), hidden_states.shape[0], hidden_states.shape[1],
                                attention_mask, past_key_values)
        if docs is not None:  # one padded row per document, then back (retrofit.layers.documents)
            out, _ = self.forward(docs.split(hidden_states), _split_pair(docs, position_embeddings), docs.valid)
            return docs.merge(out), None
        q, k, v = self.patch.project_qkv(self, hidden_states, position_embeddings)
        valid = self.key_padding(attention_mask, hidden_states.shape[1])
        cache = layer_cache(past_key_values, self.layer_idx, self.new_cache_layer)
        out = self.attend(q, k, v, valid, cache, hidden_states=hidden_states, position_embeddings=position_embeddings)
        return self.patch.project_out(self, out), None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None,
        cache: RetrofitLayerCache | None,
        *,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The method's attention over the pretrained projections (what each method writes).

        Args:
            q: ``(B, Hq, T, d)`` queries as the family builds them (q norm, RoPE).
            k: ``(B, Hkv, T, d)`` keys (k norm, RoPE); v: ``(B, Hkv, T, D)`` values.
            valid: ``(B, T)`` bool, False at padding; None: no padding.
            cache: this layer's decoding-cache entry (from :meth:`new_cache_layer`), None without a cache.
            hidden_states: ``(B, T, hidden)``, for methods with projections of their own.
            position_embeddings: ``(cos, sin)`` as passed to :meth:`forward`.

        Returns:
            ``(B, Hq, T, D)`` per-head outputs, before the pretrained output projection.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ distillation
    def __call__(self, *args: Any, **kwargs: Any):
        if "cache" in kwargs:  # transformers >= 5.24 hands the cache over as `cache`; layers read past_key_values
            cache = kwargs.pop("cache")
            if kwargs.get("past_key_values") is None:
                kwargs["past_key_values"] = cache
        if self.distill_mode is None:
            return super().__call__(*args, **kwargs)
        hidden_states = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        docs = packed_documents(kwargs.get("position_ids"), hidden_states.shape[0], hidden_states.shape[1],
                                kwargs.get("attention_mask"), kwargs.get("past_key_values"))
        if docs is not None:  # teacher and student both read one document per row
            return self._distill_per_document(docs, hidden_states, kwargs)
        position_embeddings = kwargs.get("position_embeddings")
        attention_mask = kwargs.get("attention_mask")
        with torch.no_grad(), adapters_off(self):  # the pretrained attention, not the adapted one
            teacher = self.original_attention(hidden_states, position_embeddings, attention_mask)
        if self.distill_mode == "transfer":
            kwargs["past_key_values"] = None
            student, _ = super().__call__(hidden_states, **kwargs)
            self.transfer_loss = self._relative_mse(student, teacher, attention_mask)
        elif self.distill_mode == "weights":
            self.transfer_loss = self.attention_weights_loss(hidden_states, position_embeddings, attention_mask)
        return teacher, None

    def _distill_per_document(self, docs: DocumentBatch, hidden_states: torch.Tensor,
                              kwargs: dict) -> tuple[torch.Tensor, None]:
        """A distilling call on packed documents, run on their padded per-document batch: the
        teacher's softmax, the student and ``transfer_loss`` (its real tokens are the packed
        batch's, so the loss is the same sum) all see one document per row."""
        kwargs = dict(kwargs, attention_mask=docs.valid,
                      position_embeddings=_split_pair(docs, kwargs.get("position_embeddings")))
        kwargs.pop("position_ids", None)
        weights = self.transfer_position_weights
        if weights is not None:
            self.transfer_position_weights = docs.split(weights.to(hidden_states.device))
        try:
            out, _ = self(docs.split(hidden_states), **kwargs)
        finally:
            self.transfer_position_weights = weights
        return docs.merge(out), None

    def attention_weights_loss(self, hidden_states: torch.Tensor, position_embeddings: Any,
                               attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Scalar: KL(pretrained attention weights || this layer's) on ``hidden_states (B, T, hidden)``,
        for methods declaring the ``"attention_weights"`` capability."""
        raise NotImplementedError(f"method {self.method!r} defines no attention weights to distil "
                                  "(train.objective weights needs the attention_weights capability)")

    def _relative_mse(self, student: torch.Tensor, teacher: torch.Tensor, attention_mask: Any) -> torch.Tensor:
        """``sum_t w_t |student_t - teacher_t|^2 / sum_t w_t |teacher_t|^2``: w = the real tokens times
        ``transfer_position_weights`` (all 1 when neither is given)."""
        err = (student.float() - teacher.float()).pow(2).mean(-1)  # (B, T)
        ref = teacher.float().pow(2).mean(-1)
        valid = self.key_padding(attention_mask, student.shape[1])
        w = None if valid is None else valid.to(err.dtype)
        if self.transfer_position_weights is not None:
            pw = self.transfer_position_weights.to(device=err.device, dtype=err.dtype)
            w = pw if w is None else w * pw
        if w is not None:
            return (err * w).sum() / (ref * w).sum().clamp_min(1e-12)
        return err.sum() / ref.sum().clamp_min(1e-12)

    def original_attention(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The pretrained attention this layer replaced: ``(B, T, hidden)`` -> ``(B, T, hidden)``.

        Full causal softmax over the T tokens (or the layer's native sliding window), with the
        family's q/k norms, RoPE, scaling and soft-cap; no cache. Padded keys are never attended.
        Past ``teacher_rope_cap`` (set by :func:`retrofit.convert` to the spec's ``rope_cap``, by
        default the base's context) the distances are capped, as on the layers a conversion keeps as full attention: beyond its
        context the base's own attention is the collapsed model, and the capped base is its
        strongest zero-shot form there (:mod:`retrofit.surgery.rope_cap`). Nothing changes within
        the cap.
        """
        B, T, _ = hidden_states.shape
        q, k, v = self.patch.project_qkv(self, hidden_states, position_embeddings)
        valid = self.key_padding(attention_mask, T)
        window = self.native_window if self.native_window else T  # a window >= T is full causal attention
        cap = self.teacher_rope_cap
        if window >= T and cap and T - 1 > cap and self.rope_inv_freq is not None:
            out = capped_rope_attention(q, k, v, cap, self.rope_inv_freq.to(q.device), scaling=self.scaling,
                                        softcap=self.softcap, key_padding_mask=valid)
        elif valid is None and not self.softcap and window >= T:
            out = gqa_sdpa(q, k, v, is_causal=True, scale=self.scaling)
        else:
            out = sliding_window_attention(q, k, v, window, scaling=self.scaling, softcap=self.softcap,
                                           key_padding_mask=valid)
        return self.patch.project_out(self, out.to(v.dtype))

    # ------------------------------------------------------------------ helpers
    @property
    def _weight_ref(self) -> torch.Tensor:
        return self.patch.out_proj(self).weight  # every family has one output projection

    def new_parameter_names(self) -> list[str]:
        """Names (relative to this module) of the parameters the method added."""
        return [f"{m}.{n}" for m in self.new_module_names if getattr(self, m, None) is not None
                for n, _ in getattr(self, m).named_parameters()]

    def supports(self, capability: str) -> bool:
        """Whether this layer takes part in the training behaviour ``capability`` (e.g.
        ``"window_dropout"``): its method declares it in ``MethodConfig.capabilities``; a layer
        overrides this where its own settings rule it out."""
        info = registered_method(self.method)
        return info is not None and capability in info.config.capabilities

    def new_cache_layer(self) -> RetrofitLayerCache:
        """A fresh decoding-cache entry for this layer."""
        raise NotImplementedError

    @staticmethod
    def key_padding(attention_mask: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
        """``(B, num_new)`` bool flags of the new tokens from the 2D mask, or None (no padding)."""
        if attention_mask is None:
            return None
        if isinstance(attention_mask, dict) or attention_mask.ndim != 2:
            raise ValueError(
                "a converted (retrofit) attention layer needs the 2D key padding mask, got "
                f"{getattr(attention_mask, 'shape', type(attention_mask))}: keep the converted model's attention "
                "implementation at 'retrofit' (model.set_attn_implementation('retrofit'))"
            )
        return attention_mask[:, -num_new:].bool()

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, heads={self.num_heads}/{self.num_kv_heads}, head_dim={self.head_dim}"
