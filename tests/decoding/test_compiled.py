"""The compiled decoding step (retrofit.decoding.CompiledDecoder) against the model's own decoding.

The reference is the converted model's forward with retrofit's cache, one token per call (itself
tested against full forwards in tests/test_generate.py). The step runs first as plain PyTorch
(``compile=False``) over the families and options it supports, then compiled once (fullgraph,
weights frozen) with recompiles made an error, so a step that changed the graph from token to
token would fail.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from retrofit.decoding import SUPPORTED_FAMILIES, CompiledDecoder, compiled_decoding_support, cpu_compiler_available
from retrofit.errors import RetrofitError
from retrofit.surgery import ConversionSpec, convert
from tests.surgery.tiny import VOCAB, tiny_model

WINDOW = 8
STEPS = 30  # past the window (ring wraps) and past the sinks' RoPE cap (max_position_embeddings 32)


def _converted(family="llama", *, method="macchiato", dtype=torch.float32, latents=8, sinks=2, conv_size=0, share=0.5,
               scale=1.0, memory_distance=5):
    base = tiny_model(family, max_position_embeddings=32)
    if method == "hedgehog":
        spec = ConversionSpec(method="hedgehog", window=WINDOW, sinks=sinks, features=8, memory_distance=memory_distance,
                              seed=0)
    elif method == "delta":
        spec = ConversionSpec(method="delta", window=WINDOW, sinks=sinks, init_swa_share=share, memory_half_life=16,
                              seed=0)
    else:
        spec = ConversionSpec(method="macchiato", window=WINDOW, latents=latents, sinks=sinks, conv_size=conv_size,
                              init_swa_share=share, seed=0)
    model = convert(base, spec).eval()
    with torch.no_grad():  # trained-looking new weights; scale > 1 pushes the mixing and latent logits far out
        for layer in model.model.layers:
            attn = layer.self_attn
            if method == "hedgehog":
                for p in (attn.feature_query.weight, attn.feature_key.weight):
                    p.add_(torch.randn_like(p), alpha=0.3 * scale)
                attn.memory_scale.weight.normal_(0.0, 0.3 * scale)
                attn.memory_scale.count_weight.normal_(0.0, 0.3)
                continue
            if method == "delta":
                for name in ("memory_gate", "memory_beta", "memory_decay"):
                    getattr(attn, name).weight.normal_(0.0, 0.3 * scale)
                for name in ("memory_query_map", "memory_key_map"):
                    getattr(attn, name).weight.add_(torch.randn_like(getattr(attn, name).weight), alpha=0.3)
                continue
            attn.latent_q.weight.normal_(0.0, 0.3 * scale)
            if attn.latent_k is not None:
                attn.latent_k.weight.normal_(0.0, 0.3 * scale)
    return model.to(dtype)


def _reference_logits(model, prompt, steps):
    """Logits of the model's own cached decoding: the prompt's last token, then each greedy step."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True, past_key_values=cache)
        logits, tokens = [out.logits[:, -1].float()], []
        for _ in range(steps):
            tok = logits[-1].argmax(-1, keepdim=True)
            out = model(input_ids=tok, use_cache=True, past_key_values=out.past_key_values)
            tokens.append(tok)
            logits.append(out.logits[:, -1].float())
    return logits, tokens


def _decoder_logits(decoder, prompt, tokens):
    logits = [decoder.prefill(prompt)]
    for tok in tokens:  # the reference's tokens, so a near-tie cannot send the two apart
        logits.append(decoder.step(tok))
    return logits


def _prompt(batch=2, length=13, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


CASES = {
    "llama, sinks past the RoPE cap": dict(family="llama"),
    "llama, conv on the latent branch": dict(family="llama", conv_size=3, sinks=0),
    "llama, large logits": dict(family="llama", scale=30.0),
    "llama, window only (no latents)": dict(family="llama", latents=0),
    "mistral": dict(family="mistral"),
    "qwen2 (q/k/v biases)": dict(family="qwen2"),
    "qwen3 (q/k norms)": dict(family="qwen3"),
    "phi3 (fused qkv, partial RoPE)": dict(family="phi3"),
    "delta memory, llama, sinks past the RoPE cap": dict(family="llama", method="delta"),
    "delta memory, large logits, no sinks": dict(family="llama", method="delta", sinks=0, scale=30.0),
    "delta memory, phi3 (fused qkv, partial RoPE)": dict(family="phi3", method="delta"),
    "hedgehog read, llama, position-free, sinks past the RoPE cap": dict(family="llama", method="hedgehog"),
    "hedgehog read, large logits, true distances, no sinks": dict(family="llama", method="hedgehog", sinks=0,
                                                                  scale=30.0, memory_distance=None),
    "hedgehog read, phi3 (fused qkv, partial RoPE)": dict(family="phi3", method="hedgehog"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_step_equals_the_models_own_decoding(case):
    model = _converted(**CASES[case])
    prompt = _prompt()
    ref, tokens = _reference_logits(model, prompt, STEPS)
    got = _decoder_logits(CompiledDecoder(model, compile=False), prompt, tokens)
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=f"{case}: token {i}")


@pytest.mark.parametrize("method", ["macchiato", "delta", "hedgehog"])
def test_closed_latent_path_is_the_window_alone(method):
    model = _converted(method=method)
    for layer in model.model.layers:
        layer.self_attn.latent_path_closed = True
    prompt = _prompt(batch=1)
    ref, tokens = _reference_logits(model, prompt, STEPS)
    got = _decoder_logits(CompiledDecoder(model, compile=False), prompt, tokens)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_bf16_step_follows_the_bf16_model():
    model = _converted(dtype=torch.bfloat16)
    prompt = _prompt()
    ref, tokens = _reference_logits(model, prompt, STEPS)
    got = _decoder_logits(CompiledDecoder(model, compile=False), prompt, tokens)
    scale = max(r.abs().max().item() for r in ref)
    for i, (a, b) in enumerate(zip(got, ref)):  # same bf16 products, summed in another order
        assert (a - b).abs().max().item() <= 0.02 * scale, i


def test_prompt_shorter_than_the_window_then_past_it():
    model = _converted()
    prompt = _prompt(batch=1, length=3)  # window still filling, sinks complete (2 <= 3)
    ref, tokens = _reference_logits(model, prompt, STEPS)
    got = _decoder_logits(CompiledDecoder(model, compile=False), prompt, tokens)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_compiler_available(), reason="torch.compile on a CPU needs a C++ compiler")
@pytest.mark.parametrize("method", ["macchiato", "delta", "hedgehog"])
def test_compiled_step_is_one_graph_and_equals_the_eager_step(method):
    model = _converted(method=method)
    prompt = _prompt()
    ref, tokens = _reference_logits(model, prompt, STEPS)
    decoder = CompiledDecoder(model)  # compiled, weights frozen
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _decoder_logits(decoder, prompt, tokens)
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"token {i}")
    assert decoder.position == prompt.shape[1] + STEPS
    # the same decoder on another prompt of another length: the graph is reused with the new state
    other = _prompt(length=21, seed=1)
    ref, other_tokens = _reference_logits(model, other, 12)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _decoder_logits(decoder, other, other_tokens)
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"second prompt, token {i}")
    # the frozen graph holds the weights it was compiled with: a change must not go unnoticed
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    with pytest.raises(RetrofitError, match="weights changed"):
        decoder.step(tokens[-1])
    # a new decoder of the same model compiles its own graph with the new weights
    ref, tokens = _reference_logits(model, prompt, 3)
    got = _decoder_logits(CompiledDecoder(model), prompt, tokens)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["macchiato", "delta", "hedgehog"])
def test_state_is_constant_in_the_context_length(method):
    model = _converted(method=method)
    sizes = []
    for length in (16, 64):
        decoder = CompiledDecoder(model, compile=False)
        decoder.prefill(_prompt(batch=1, length=length))
        sizes.append(decoder.memory_bytes())
    assert sizes[0] == sizes[1] > 0
    if method != "macchiato":  # the memories are held beyond the window's slots, fp32: delta (B, H, d, d),
        cfg = model.config     # hedgehog (B, H, 2 f, d) and (B, H, 2 f)
        d = cfg.hidden_size // cfg.num_attention_heads
        window_only = _converted(method="macchiato", latents=0)
        decoder = CompiledDecoder(window_only, compile=False)
        decoder.prefill(_prompt(batch=1, length=16))
        per_head = d * d if method == "delta" else 2 * 8 * (d + 1)
        assert sizes[0] - decoder.memory_bytes() == cfg.num_hidden_layers * cfg.num_attention_heads * per_head * 4


def test_a_prompt_run_with_the_hedgehog_read_closed_is_refused_open():
    model = _converted(method="hedgehog")
    for layer in model.model.layers:
        layer.self_attn.latent_path_closed = True
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=_prompt(batch=1), use_cache=True, past_key_values=cache)
    for layer in model.model.layers:
        layer.self_attn.latent_path_closed = False
    with pytest.raises(RetrofitError, match="read closed"):
        CompiledDecoder(model, compile=False).adopt(cache)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_unsupported_families_are_refused_with_the_reason(family):
    assert family not in SUPPORTED_FAMILIES
    base = tiny_model(family)
    model = convert(base, ConversionSpec(method="macchiato", window=WINDOW, latents=8, layers="all")).eval()
    reason = compiled_decoding_support(model)
    assert reason is not None and ("families" in reason or "soft-cap" in reason)
    with pytest.raises(RetrofitError):
        CompiledDecoder(model, compile=False)


def test_a_layer_left_as_softmax_attention_is_refused():
    base = tiny_model("llama")
    model = convert(base, ConversionSpec(method="macchiato", window=WINDOW, latents=8, layers=[0])).eval()
    assert "layer 1" in compiled_decoding_support(model)


def test_dynamic_ntk_is_refused():
    from retrofit.surgery.rope_scaling import scale_rope

    model = _converted(sinks=4)
    assert compiled_decoding_support(model) is None
    scale_rope(model, "dynamic", 4.0)
    assert "dynamic NTK" in compiled_decoding_support(model)


def test_misuse_gets_one_clear_error():
    model = _converted(sinks=4)
    decoder = CompiledDecoder(model, compile=False)
    with pytest.raises(RetrofitError, match="prefill"):
        decoder.step(torch.tensor([[5]]))
    with pytest.raises(RetrofitError, match="batch, tokens"):
        decoder.prefill(torch.tensor([5, 6, 7]))
    with pytest.raises(RetrofitError, match="sinks"):
        decoder.prefill(_prompt(batch=1, length=3))  # 3 tokens, 4 sinks
    with pytest.raises(RetrofitError, match="prefill_chunk"):
        CompiledDecoder(model, prefill_chunk=0)


def test_docstring_example_runs_as_written():
    import doctest

    import retrofit.decoding.compiled as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0 and result.failed == 0, result
