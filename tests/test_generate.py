"""Decoding with converted models: prefill + token-by-token == full forward, batched left-padded
== per-sequence, and model.generate (greedy and sampling) on the constant-memory cache."""
from __future__ import annotations

import pytest
import torch

from retrofit.layers.cache import RetrofitCache, RetrofitLayerCache
from retrofit.surgery import ConversionSpec, convert, new_parameter_names
from tests.surgery.tiny import tiny_model

W = 16


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _converted(family, method, **kw):
    if method == "macchiato":
        kw = dict(window=W, latents=8, **kw)
    else:  # exp-linear has no window / latents / conv / sinks keys (an error since f39ba40)
        assert not any(kw.pop(k, 0) for k in ("conv_size", "sinks"))
    model = convert(tiny_model(family), ConversionSpec(method=method, chunk_size=16, **kw))
    params = dict(model.named_parameters())
    with torch.no_grad():  # trained-looking mixing weights: the latent path carries real weight
        for n in new_parameter_names(model):
            if "latent_q.weight" in n:
                params[n].normal_(0, 0.3)
    return model


@pytest.mark.parametrize("family,method,conv,sinks", [
    ("llama", "macchiato", 0, 0), ("gemma3", "macchiato", 3, 0), ("gemma2", "exp-linear", 0, 0),
    ("qwen2", "exp-linear", 0, 0), ("gemma3", "macchiato", 0, 4), ("gemma2", "macchiato", 2, 1),
    ("qwen3", "exp-linear", 0, 0), ("phi3", "macchiato", 2, 1),
])
def test_prefill_then_steps_equal_full_forward(family, method, conv, sinks):
    model = _converted(family, method, conv_size=conv, **({"sinks": sinks} if sinks else {}))
    T, prefill = 320, 100  # w = 16 is far shorter than the prompt
    ids = torch.randint(3, 256, (1, T))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = RetrofitCache(model)
        steps = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for t in range(prefill, T - 60):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
        steps.append(model(ids[:, T - 60 :], past_key_values=cache, use_cache=True).logits)  # chunked continuation
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def _left_padded(seqs, pad_id=0):
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s) :] = s
        mask[i, T - len(s) :] = 1
    return ids, mask


@pytest.mark.parametrize("family,method,layers,sinks", [
    ("llama", "macchiato", "all", 0), ("gemma3", "macchiato", [0], 0), ("gemma2", "exp-linear", "all", 0),
    ("llama", "macchiato", "all", 2),
])
def test_batched_left_padded_generation_equals_per_sequence(family, method, layers, sinks):
    kw = {"conv_size": 2} if method == "macchiato" else {}
    model = _converted(family, method, layers=layers, **kw, **({"sinks": sinks} if sinks else {}))
    seqs = [torch.randint(3, 256, (n,)) for n in (40, 23, 31)]
    ids, mask = _left_padded(seqs)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    batched = model.generate(ids, attention_mask=mask, **kw)
    for i, s in enumerate(seqs):
        single = model.generate(s[None], **kw)
        assert torch.equal(batched.sequences[i, ids.shape[1] :], single.sequences[0, len(s) :])
        for lb, ls in zip(batched.logits, single.logits):
            torch.testing.assert_close(lb[i], ls[0], rtol=1e-4, atol=1e-4)


def test_generate_greedy_and_sampling_use_the_constant_memory_cache():
    model = _converted("gemma3", "macchiato")
    prompt = torch.randint(3, 256, (2, 30))
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 70)
    layers = out.past_key_values.layers
    assert all(isinstance(l, RetrofitLayerCache) for l in layers)  # adopted automatically
    assert all(l.buffered == W - 1 and l.get_seq_length() == 69 for l in layers)
    short = model.generate(prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert sum(l.memory_bytes() for l in short.past_key_values.layers) == sum(l.memory_bytes() for l in layers)
    torch.manual_seed(1)
    s1 = model.generate(prompt, max_new_tokens=20, do_sample=True, temperature=0.9, top_p=0.9)
    torch.manual_seed(1)
    s2 = model.generate(prompt, max_new_tokens=20, do_sample=True, temperature=0.9, top_p=0.9,
                        past_key_values=RetrofitCache(model))
    assert s1.shape == (2, 50) and torch.equal(s1, s2)
