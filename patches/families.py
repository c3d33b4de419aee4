"""The family table: one :class:`~retrofit.patches.base.Family` row per supported model family.

Adding a family is adding a row here (and its tiny model to the test table, ``tests/surgery/tiny.py``);
code (a ``Family.hooks`` subclass of AttentionPatch, in this file) only where its math truly differs.

Family facts the rows record (transformers 5.x modeling code):

* llama: the reference LLaMA attention, scaling d**-0.5, no window.
* mistral: LLaMA attention; every layer uses ``config.sliding_window`` if set.
* qwen2: LLaMA attention with q/k/v biases; sliding window per ``config.layer_types``.
* qwen3: Qwen2 plus per-head RMS ``q_norm`` / ``k_norm`` before RoPE (as Gemma 3).
* phi3: one fused ``qkv_proj`` whose output is ``[q | k | v]``, ``o_proj``; partial RoPE
  (``partial_rotary_factor``, inside the family's ``apply_rotary_pos_emb``); every layer uses
  ``config.sliding_window`` if set; the MLP is a fused ``gate_up_proj`` + ``down_proj``.
* gemma: LLaMA attention (scaling head_dim**-0.5), GeGLU MLP elsewhere; needs BOS.
* gemma2: scaling ``query_pre_attn_scalar**-0.5``, attention-logit soft-capping
  ``tanh(s / c) * c`` with ``c = config.attn_logit_softcapping``, alternating sliding-window and
  global layers per ``config.layer_types``; needs BOS.
* gemma3 (text, ``gemma3_text``): per-head RMS q_norm / k_norm before RoPE, scaling
  ``query_pre_attn_scalar**-0.5``, 5 local : 1 global layers with a different RoPE base per layer
  type. The decoder computes one ``(cos, sin)`` per layer type and hands each layer the pair of its
  own type, so a replacement layer receives the right RoPE without knowing its type. Gemma 3
  applies no logit soft-capping (its forward never passes ``softcap``, whatever
  ``config.attn_logit_softcapping`` says); needs BOS.
"""
from __future__ import annotations

from retrofit.patches.base import Family

__all__ = ["FAMILIES"]


def _tf(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), _tf("llama"), "LlamaAttention"),
    Family("mistral", ("mistral",), _tf("mistral"), "MistralAttention", window="config"),
    Family("qwen2", ("qwen2",), _tf("qwen2"), "Qwen2Attention", window="layer"),
    Family("qwen3", ("qwen3",), _tf("qwen3"), "Qwen3Attention", window="layer", qk_norms=("q_norm", "k_norm")),
    Family("phi3", ("phi3",), _tf("phi3"), "Phi3Attention", qkv=("qkv_proj",), window="config",
           lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("gemma", ("gemma",), _tf("gemma"), "GemmaAttention", needs_bos=True),
    Family("gemma2", ("gemma2",), _tf("gemma2"), "Gemma2Attention", window="layer",
           softcap_attr="attn_logit_softcapping", needs_bos=True),
    Family("gemma3", ("gemma3_text",), _tf("gemma3"), "Gemma3Attention", window="layer",
           qk_norms=("q_norm", "k_norm"), needs_bos=True, wrappers=("gemma3",)),
)
