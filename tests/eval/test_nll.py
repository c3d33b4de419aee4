"""Sliced-logit / chunked NLL equals the model's own full logits, for base, Gemma and converted models."""
from __future__ import annotations

import math

import pytest
import torch

from retrofit.eval import nll

from .tiny import tiny_gemma3, tiny_llama


@pytest.fixture(scope="module")
def ids(tokenizer):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, len(tokenizer), (200,), generator=g)


def _converted(tokenizer):
    import retrofit

    model = tiny_llama(len(tokenizer), seed=3)
    return retrofit.convert(model, retrofit.ConversionSpec(method="macchiato", window=16, latents=8)).eval()


@pytest.mark.parametrize("kind", ["llama", "gemma3-softcap", "converted"])
def test_sliced_and_chunked_match_full_logits(kind, tokenizer, ids):
    model = {"llama": lambda: tiny_llama(len(tokenizer)), "gemma3-softcap": lambda: tiny_gemma3(len(tokenizer)),
             "converted": lambda: _converted(tokenizer)}[kind]()
    ref, n = nll.window_nll_full(model, ids)
    assert n == ids.numel() - 1
    assert nll.check_sliced_head(model, ids)
    for kwargs in ({}, {"slice_tokens": 7}, {"chunk_size": 48, "slice_tokens": 13}):
        got, m = nll.window_nll(model, ids, **kwargs)
        assert m == n
        assert got == pytest.approx(ref, rel=1e-5), kwargs


def test_softcap_is_applied(tokenizer, ids):
    model = tiny_gemma3(len(tokenizer), final_logit_softcapping=0.5)
    hidden = model.model(input_ids=ids[None, :8]).last_hidden_state
    logits = nll.head_logits(model, hidden)
    assert logits.abs().max() <= 0.5 + 1e-6
    torch.testing.assert_close(logits, model(input_ids=ids[None, :8]).logits.float())


def test_guard_detects_unreproduced_logit_postprocessing(tokenizer, ids):
    model = tiny_llama(len(tokenizer))
    original = model.forward

    def scaled_forward(*args, **kwargs):  # a family that rescales its logits after lm_head
        out = original(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    model.forward = scaled_forward
    with pytest.warns(UserWarning, match="falling back"):
        assert not nll.check_sliced_head(model, ids)


def test_slice_size_and_perplexity():
    from retrofit.ops.linear_ce import TOKEN_BLOCK, VOCAB_BLOCK

    assert nll.slice_tokens_for(262_144) == min(TOKEN_BLOCK, nll.DEFAULT_LOGIT_BUDGET // VOCAB_BLOCK)
    assert nll.slice_tokens_for(262_144, 10 * VOCAB_BLOCK) == 10  # a small budget: smaller blocks
    assert nll.slice_tokens_for(100, 1000) == 10  # a small vocabulary is one block wide
    assert nll.slice_tokens_for(10**9, 1) == 1
    assert nll.perplexity(2.0 * 10, 10) == pytest.approx(math.exp(2.0))
    assert nll.perplexity(1e6, 1) == float("inf")


def test_scoring_attention_keeps_the_numbers_and_restores_the_model(tokenizer, ids):
    """A base Gemma 3 scored under the "retrofit" attention (its sliding layers through the blocked
    O(T w) kernel, keys far outrunning the 16-token window in a chunked forward) gives the stock
    SDPA numbers, and the model's implementation is put back afterwards."""
    from retrofit.eval import loading

    model = tiny_gemma3(len(tokenizer), attn_implementation="sdpa")
    stock = nll.window_token_nll(model, ids, chunk_size=48, slice_tokens=13)
    calls = []
    from retrofit import ops

    real = ops.sliding_window_attention
    with pytest.MonkeyPatch.context() as mp:  # count, do not replace: the kernel must really run
        mp.setattr(ops, "sliding_window_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        with loading.scoring_attention(model) as impl:
            assert impl == "retrofit" and model.config._attn_implementation == "retrofit"
            fast = nll.window_token_nll(model, ids, chunk_size=48, slice_tokens=13)
    assert calls, "the sliding-window layer did not take the blocked kernel"
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(fast, stock, rtol=1e-5, atol=1e-5)


def test_scoring_attention_leaves_other_models_alone(tokenizer):
    from retrofit.eval import loading

    llama = tiny_llama(len(tokenizer))  # no native window: nothing to gain
    with loading.scoring_attention(llama) as impl:
        assert impl == llama.config._attn_implementation != "retrofit"
    converted = _converted(tokenizer)
    with loading.scoring_attention(converted) as impl:
        assert impl == "retrofit"  # already converted: untouched
