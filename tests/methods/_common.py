"""Tiny models of every supported family (from the one test table, ``tests/surgery/tiny.py``) and an
independent pattern reference for method tests.

The reference runs the ORIGINAL (unconverted) attention modules through a registered eager
attention function that applies a dense mask given as a predicate over real-token ranks
(``allowed(q_rank, k_rank)``); no retrofit layer or op is involved.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from retrofit.layers.cache import RetrofitCache
from tests.surgery.tiny import FAMILIES, VOCAB, tiny_model  # noqa: F401  (the one family table)


def batch(B: int = 2, T: int = 30, left_pad: tuple[int, ...] = (0, 5), seed: int = 0):
    """``(input_ids, attention_mask, position_ids)`` with left padding; positions count real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, p in enumerate(left_pad[:B]):
        mask[b, :p] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


# ---------------------------------------------------------------------- pattern reference
_NAME = "retrofit_test_rank_pattern"
_PATTERNS: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def _mask_fn(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kw):
    return attention_mask


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kw):
    B, H, T, _ = query.shape
    K = key.shape[2]
    group = H // key.shape[1]
    k = key.repeat_interleave(group, dim=1).double()
    v = value.repeat_interleave(group, dim=1).double()
    scores = torch.matmul(query.double(), k.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    valid = torch.ones(B, K, dtype=torch.bool) if attention_mask is None else attention_mask[:, -K:].bool()
    rank = valid.long().cumsum(1) - 1
    qr, kr = rank[:, -T:, None], rank[:, None, :]
    allowed = _PATTERNS[id(module.config)](qr, kr) & valid[:, None, :]
    self_key = torch.arange(K)[None, :] == torch.arange(T)[:, None] + (K - T)
    allowed = allowed | (~valid[:, -T:, None] & self_key[None])  # padded queries: finite rows
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def pattern_reference(model: torch.nn.Module, allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """A deep copy of the base ``model`` whose every layer attends where ``allowed(q_rank, k_rank)``."""
    AttentionInterface.register(_NAME, _attention)
    AttentionMaskInterface.register(_NAME, _mask_fn)
    ref = copy.deepcopy(model)
    _PATTERNS[id(ref.config)] = allowed
    ref.set_attn_implementation(_NAME)
    return ref


def decode_logits(model, ids, mask, pos, prefill: int) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens then one token at a time through the model's cache."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = model(input_ids=ids[:, :prefill], attention_mask=mask[:, :prefill], position_ids=pos[:, :prefill],
                    past_key_values=DynamicCache(config=model.config), use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(prefill, ids.shape[1]):
            out = model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=pos[:, t : t + 1],
                        past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    return torch.cat(logits, dim=1), cache


def attention_inputs(model, T=37, B=2):
    """hidden states and (cos, sin) exactly as the first decoder layer passes them."""
    seen = {}
    attn = model.model.layers[0].self_attn
    h = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(3, 256, (B, T)))
    h.remove()
    return seen["hidden_states"], seen["position_embeddings"]


def saved_weights(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder``."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_generate_batched_equals_single(model, T: int, pad: int, max_new_tokens: int) -> None:
    """Greedy ``generate`` on a batch whose row 1 has ``pad`` left-padding tokens equals that row alone."""
    ids, mask, _ = batch(T=T, left_pad=(0, pad))
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        both = model.generate(input_ids=ids, attention_mask=mask, **kw)
        one = model.generate(input_ids=ids[1:, pad:], attention_mask=mask[1:, pad:], **kw)
    assert torch.equal(both[1, pad:], one[0])


def stepwise_logits(model, ids, mask, prefill, slots: bool, chunk_after: int | None = None):
    """Logits of a prefill, then one token at a time (a 5-token chunk at ``chunk_after``), through a
    :class:`RetrofitCache`; ``slots``: the layers' in-place decoding slots or their general path."""
    for m in model.modules():
        if hasattr(m, "slot_decoding"):
            m.slot_decoding = slots
    cache = RetrofitCache(model)
    outs = []
    with torch.no_grad():
        outs.append(model(ids[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache, use_cache=True).logits)
        t = prefill
        while t < ids.shape[1]:
            n = 5 if t == chunk_after else 1
            outs.append(model(ids[:, t : t + n], attention_mask=mask[:, : t + n], past_key_values=cache, use_cache=True).logits)
            t += n
    return torch.cat(outs, dim=1), cache


def assert_closed_is_the_window_with_sinks(method: str, window: int, options: dict, perturb) -> None:
    """Closed (the eval's `closed` variant, the probe), a ``method`` conversion with 2 sinks is the
    base run with a ``window``-token window plus those sinks, whatever ``perturb(model)`` did to its
    new weights; open, it is not."""
    from retrofit.surgery import convert
    from retrofit.surgery.probe import closed_latent_path

    base = tiny_model("qwen2")
    ref = pattern_reference(base, lambda qr, kr: (kr <= qr) & ((kr > qr - window) | (kr < 2)))
    model = convert(base, method=method, window=window, options={"sinks": 2, **options})
    perturb(model)
    ids, mask, pos = batch(T=25)
    real = mask.bool()
    with torch.no_grad(), closed_latent_path(model) as closed:
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert closed == 2
    torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=2e-4)
    with torch.no_grad():
        opened = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert not torch.allclose(opened[real], want[real], atol=1e-2)


def perturb_new_weights(model: torch.nn.Module, scale: float = 0.5) -> None:
    """Add seeded noise to every trainable weight (trained-looking new weights)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g))
