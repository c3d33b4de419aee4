"""The cache argument's name: transformers >= 5.24 takes ``cache``, earlier 5.x ``past_key_values``."""
from __future__ import annotations

from types import SimpleNamespace

from retrofit.layers.cache import cache_keyword, output_cache


def test_keyword_follows_the_signature():
    def new_style(input_ids=None, cache=None, **kwargs): ...
    def old_style(input_ids=None, past_key_values=None, **kwargs): ...
    def wrapped(*args, **kwargs): ...  # e.g. a PEFT wrapper: the old name, accepted until 5.40

    assert cache_keyword(new_style) == "cache"
    assert cache_keyword(old_style) == "past_key_values"
    assert cache_keyword(wrapped) == "past_key_values"


def test_output_cache_reads_either_name():
    c = object()
    assert output_cache(SimpleNamespace(cache=c)) is c
    assert output_cache(SimpleNamespace(cache=None, past_key_values=c)) is c
    assert output_cache(SimpleNamespace(past_key_values=c)) is c


def test_installed_transformers_model_takes_the_keyword_it_names():
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    keyword = cache_keyword(model.forward)
    assert keyword in ("cache", "past_key_values")
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) >= (5, 24):
        assert keyword == "cache"


def test_converted_layer_takes_its_cache_under_either_name():
    """RetrofitAttention passes ``cache=`` on as ``past_key_values``: both calls fill a cache and agree."""
    import torch

    from retrofit.layers.cache import RetrofitCache
    from retrofit.surgery import ConversionSpec, convert
    from tests.surgery.tiny import tiny_model

    model = convert(tiny_model("llama"), ConversionSpec(window=4, latents=8))
    attn = model.model.layers[0].self_attn
    h = torch.randn(1, 9, model.config.hidden_size)
    pe = model.model.rotary_emb(h, torch.arange(9)[None])
    outs, caches = [], []
    for name in ("cache", "past_key_values"):
        cache = RetrofitCache(model)
        with torch.no_grad():
            outs.append(attn(hidden_states=h[:, :5], position_embeddings=tuple(x[:, :5] for x in pe), **{name: cache})[0])
            outs.append(attn(hidden_states=h[:, 5:], position_embeddings=tuple(x[:, 5:] for x in pe), **{name: cache})[0])
        caches.append(cache)
    with torch.no_grad():
        whole = attn(hidden_states=h, position_embeddings=pe)[0]
    for c in caches:
        assert c.layers[0].cumulative_length == 9
    torch.testing.assert_close(torch.cat(outs[:2], 1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(outs[2:], 1), whole, atol=1e-5, rtol=1e-5)
