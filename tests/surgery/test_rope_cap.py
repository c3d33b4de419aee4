"""RoPE distance cap on the layers left as full attention (``rope_cap``): which layers get it, that
the model runs the capped op with the right positions (whole, chunked through the cache, decoding),
that nothing changes inside the cap, and that a converted checkpoint keeps it."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import retrofit.ops
from retrofit.errors import SpecError
from retrofit.ops import capped_rope_attention_reference
from retrofit.patches.attention import ROPE_CAP_ATTR, install_attention_function
from retrofit.surgery import ConversionSpec, convert, load, save
from retrofit.surgery.rope_cap import cap_rope, capped_layers
from tests.surgery.tiny import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 6
T = 30


def _ids(T=T, B=2, seed=0):
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids, **kw):
    return model(input_ids=ids, **kw).logits


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2", "gemma3"])
def test_capped_model_runs_the_reference_math(family, monkeypatch):
    """Whole forward with the cap = the same model whose capped layers call the op's dense reference;
    the cap changes the logits (it acts), and a cap beyond the sequence changes nothing."""
    model = tiny_model(family)
    model.set_attn_implementation(install_attention_function())  # the cap alone differs between the two runs
    ids = _ids()
    plain = _logits(model, ids)
    capped = cap_rope(model, CAP)
    full = [i for i, t in enumerate(getattr(model.config, "layer_types", None) or ["full_attention"] * 2)
            if t == "full_attention"]
    assert capped == full and capped_layers(model) == {i: CAP for i in full}
    fast = _logits(model, ids)
    assert (fast - plain).abs().amax() > 1e-3
    monkeypatch.setattr(retrofit.ops, "capped_rope_attention",
                        lambda *a, block_size=None, split=None, **kw: capped_rope_attention_reference(*a, **kw))
    torch.testing.assert_close(fast, _logits(model, ids), atol=1e-4, rtol=1e-4)
    monkeypatch.undo()
    cap_rope(model, T - 1)  # no pair is farther apart than the cap
    torch.testing.assert_close(_logits(model, ids), plain, atol=1e-5, rtol=1e-5)
    assert cap_rope(model, 0) == [] and capped_layers(model) == {}
    torch.testing.assert_close(_logits(model, ids), plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_chunked_prefill_and_decoding_match_the_whole_forward(family):
    """Queries sit at their stream positions in every call: three cached chunks, then one token at a
    time, give the logits of one forward over the whole sequence (left padding included)."""
    model = tiny_model(family)
    cap_rope(model, CAP)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: RoPE positions shift by a per-row constant, which cancels
    whole = _logits(model, ids, attention_mask=mask)
    cache, parts = DynamicCache(config=model.config), []
    for s, e in ((0, 11), (11, 23), (23, 27)):
        parts.append(_logits(model, ids[:, s:e], attention_mask=mask[:, :e], past_key_values=cache))
    for t in range(27, T):
        parts.append(_logits(model, ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache))
    got = torch.cat(parts, dim=1)
    real = mask.bool()
    torch.testing.assert_close(got[real], whole[real], atol=1e-4, rtol=1e-4)


def test_convert_caps_the_kept_full_layers_and_a_checkpoint_keeps_the_cap(tmp_path):
    model = tiny_model("gemma3", num_hidden_layers=4,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    convert(model, ConversionSpec(layers=[3], window=8, latents=4, rope_cap=CAP))
    assert capped_layers(model) == {1: CAP}  # layer 3 is converted, layers 0 and 2 slide natively
    assert model.config.retrofit["rope_cap"] == CAP
    ids = _ids()
    before = _logits(model, ids)
    save(model, tmp_path / "ckpt")
    again = load(tmp_path / "ckpt")
    assert capped_layers(again) == {1: CAP}
    torch.testing.assert_close(_logits(again, ids), before, atol=1e-5, rtol=1e-5)


def test_default_cap_is_the_base_context_and_zero_turns_it_off():
    model = tiny_model("gemma3", num_hidden_layers=4,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    convert(model, ConversionSpec(layers=[3], window=8, latents=4))
    assert model.config.retrofit["rope_cap"] == model.config.max_position_embeddings - 1
    assert capped_layers(model) == {1: model.config.max_position_embeddings - 1}
    off = tiny_model("llama")
    convert(off, ConversionSpec(layers=[0], window=8, latents=4, rope_cap=0))
    assert off.config.retrofit["rope_cap"] == 0 and capped_layers(off) == {}
    assert not hasattr(off.model.layers[1].self_attn, ROPE_CAP_ATTR)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "32k"])
def test_bad_caps_are_spec_errors(bad):
    with pytest.raises(SpecError, match="rope_cap"):
        ConversionSpec(rope_cap=bad)
    with pytest.raises(SpecError, match="rope_cap"):
        cap_rope(tiny_model("llama"), bad)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_teacher_past_the_context_is_the_capped_base(family, tmp_path):
    """A converted model's teacher (its layers switched back to the original attention) scores a
    sequence longer than the base's context as the base with its RoPE distance capped at the spec's
    rope_cap (default: the context), and as the plain base with rope_cap 0; within the context the
    cap changes nothing."""
    from retrofit.surgery.distill import distill_mode

    context = 16
    base = tiny_model(family, max_position_embeddings=context)
    base.set_attn_implementation(install_attention_function())
    ids = _ids()  # T = 30 > context
    plain = _logits(base, ids)
    cap_rope(base, context - 1)
    capped = _logits(base, ids)
    cap_rope(base, 0)
    assert (capped - plain).abs().amax() > 1e-3  # the cap acts at this length
    for rope_cap, want in ((None, capped), (0, plain)):
        model = tiny_model(family, max_position_embeddings=context)
        convert(model, ConversionSpec(layers="all" if family == "llama" else "global", window=8, latents=4,
                                      rope_cap=rope_cap))
        save(model, tmp_path / f"ckpt-{rope_cap}")
        for m in (model, load(tmp_path / f"ckpt-{rope_cap}")):  # a checkpoint's teacher is capped as its record says
            with distill_mode(m, "teacher"):
                torch.testing.assert_close(_logits(m, ids), want, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(_logits(m, ids[:, :context]), plain[:, :context], atol=1e-4, rtol=1e-4)
