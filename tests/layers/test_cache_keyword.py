"""The cache argument's name: transformers >= 5.24 takes ``cache``, earlier 5.x ``past_key_values``."""
from __future__ import annotations

from types import SimpleNamespace

from retrofit.layers.cache import cache_keyword, output_cache, passed_cache


def test_keyword_follows_the_signature():
    def new_style(input_ids=None, cache=None, **kwargs): ...
    def old_style(input_ids=None, past_key_values=None, **kwargs): ...
    def wrapped(*args, **kwargs): ...  # e.g. a PEFT wrapper: the old name, accepted until 5.40

    assert cache_keyword(new_style) == "cache"
    assert cache_keyword(old_style) == "past_key_values"
    assert cache_keyword(wrapped) == "past_key_values"


def test_output_and_passed_cache_read_either_name():
    c = object()
    assert output_cache(SimpleNamespace(cache=c)) is c
    assert output_cache(SimpleNamespace(cache=None, past_key_values=c)) is c
    assert output_cache(SimpleNamespace(past_key_values=c)) is c
    assert passed_cache(c, {}) is c
    assert passed_cache(None, {"cache": c}) is c
    assert passed_cache(None, {}) is None


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
