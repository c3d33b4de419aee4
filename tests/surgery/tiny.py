"""Tiny random models of every supported family (THE test table: one row per family), and an
honest sliding-window reference.

The reference runs the ORIGINAL (unconverted) modules through a separately registered
attention function that applies a dense causal band mask (``t - w < s <= t``) + key padding
in eager math; nothing of retrofit's layers or ops is used, so the converted model with the
latent path closed (p(0|t) = 1) must match it.
"""
from __future__ import annotations

import copy

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

VOCAB = 256

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
_FAMILY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (  # layer 1 slides (window 24): the per-layer window rule is exercised
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
             sliding_window=24, max_window_layers=1),
    ),
    "phi3": (  # fused qkv_proj, partial RoPE (half of each head rotates)
        "Phi3Config", "Phi3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
             attn_logit_softcapping=3.0, final_logit_softcapping=20.0, sliding_window=24,
             layer_types=["sliding_attention", "full_attention"]),
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
             sliding_window=24, layer_types=["sliding_attention", "full_attention"]),
    ),
}
FAMILIES = tuple(_FAMILY)


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random ``*ForCausalLM`` (fp32, eval mode). Norm weights are randomised too, so q/k norms matter."""
    cfg_name, model_name, kw = _FAMILY[family]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **kw, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif "bias" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            else:  # larger weights than the 0.02 init so attention is far from uniform
                p.mul_(5.0)
    return model


# ---------------------------------------------------------------------- SWA reference
REFERENCE = "retrofit_test_band_reference"


def _reference_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                    attention_mask=None, **kwargs):
    return attention_mask  # the raw 2D padding mask (or None)


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         sliding_window=None, softcap=None, **kwargs):
    window = module.config.reference_windows.get(str(module.layer_idx), sliding_window)
    sinks = getattr(module.config, "reference_sinks", 0) if str(module.layer_idx) in module.config.reference_windows else 0
    B, H, T, d = query.shape
    K = key.shape[2]
    group = H // key.shape[1]
    k = key.repeat_interleave(group, dim=1).double()
    v = value.repeat_interleave(group, dim=1).double()
    scores = torch.matmul(query.double(), k.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    t = torch.arange(T)[:, None] + (K - T)
    s = torch.arange(K)[None, :]
    allowed = (s <= t)
    if window is not None:
        allowed = allowed & (s > t - window)
    allowed = allowed[None, None].expand(B, 1, T, K)
    if sinks:  # attention sinks: the first `sinks` real tokens stay visible to every later query
        real = torch.ones(B, K, dtype=torch.bool) if attention_mask is None else attention_mask[:, -K:].bool()
        is_sink = real & (real.long().cumsum(-1) <= sinks)
        allowed = allowed | (is_sink[:, None, None, :] & (s <= t)[None, None])
    if attention_mask is not None:
        kv_valid = attention_mask[:, -K:].bool()
        allowed = (allowed & kv_valid[:, None, None, :]) | ((s == t)[None, None] & ~kv_valid[:, None, -T:, None])
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def band_reference(model: torch.nn.Module, window: int, layers=None, sinks: int = 0) -> torch.nn.Module:
    """A deep copy of the base ``model`` whose ``layers`` (default all) attend to the last ``window`` tokens
    (and to the first ``sinks`` real tokens)."""
    AttentionInterface.register(REFERENCE, _reference_attention)
    AttentionMaskInterface.register(REFERENCE, _reference_mask)
    ref = copy.deepcopy(model)
    n = ref.config.num_hidden_layers
    ref.config.reference_windows = {str(i): window for i in (range(n) if layers is None else layers)}
    ref.config.reference_sinks = sinks
    ref.set_attn_implementation(REFERENCE)
    return ref


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Mean over (valid) positions of KL(softmax(ref) || softmax(logits))."""
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(logits.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    if mask is not None:
        return float(kl[mask.bool()].mean())
    return float(kl.mean())


def tiny_tokenizer():
    """A byte-level BPE tokenizer (vocab <= 256, ids fit the tiny models) trained on the probe text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from retrofit.surgery.probe import PROBE_TEXT

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator([PROBE_TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
