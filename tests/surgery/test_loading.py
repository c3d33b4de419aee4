"""load_any on a GGUF file (a tiny llama written with the gguf package): cached as safetensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from retrofit.errors import CheckpointError
from retrofit.surgery import ConversionSpec, convert, load_any
from retrofit.surgery.loading import cache_root

gguf = pytest.importorskip("gguf")


def write_tiny_llama_gguf(path, vocab=64, hidden=32, layers=2, heads=4, kv=2, ff=48):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(vocab - 3)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    expected: dict[str, np.ndarray] = {}  # transformers name -> the weight the loader must produce

    def tensor(name, hf_name, *shape, rope_heads=None):
        value = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        expected[hf_name] = value
        # llama.cpp stores q/k rows permuted for its interleaved RoPE (convert_hf_to_gguf's permute);
        # the loader must undo it: a slip there scrambles every head's rotary pairs
        stored = value if rope_heads is None else llama_cpp_permute(value, rope_heads)
        w.add_tensor(name, stored)

    tensor("token_embd.weight", "model.embed_tokens.weight", vocab, hidden)
    tensor("output_norm.weight", "model.norm.weight", hidden)
    tensor("output.weight", "lm_head.weight", vocab, hidden)
    d = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}"
        tensor(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", f"{p}.self_attn.q_proj.weight", heads * d, hidden, rope_heads=heads)
        tensor(f"blk.{i}.attn_k.weight", f"{p}.self_attn.k_proj.weight", kv * d, hidden, rope_heads=kv)
        tensor(f"blk.{i}.attn_v.weight", f"{p}.self_attn.v_proj.weight", kv * d, hidden)
        tensor(f"blk.{i}.attn_output.weight", f"{p}.self_attn.o_proj.weight", hidden, heads * d)
        tensor(f"blk.{i}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_up.weight", f"{p}.mlp.up_proj.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_down.weight", f"{p}.mlp.down_proj.weight", hidden, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    write_tiny_llama_gguf.expected = expected
    return path


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter gives a LLaMA q/k projection (rotary halves interleaved)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape).copy())


def test_gguf_tensors_are_the_written_arrays(tmp_path, monkeypatch):
    """Every loaded tensor equals what the test wrote (q/k un-permuted), not merely finite."""
    monkeypatch.setenv("RETROFIT_CACHE", str(tmp_path / "cache"))
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    expected = write_tiny_llama_gguf.expected
    model, _ = load_any(path)
    state = model.state_dict()
    assert set(expected) <= set(state)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], torch.from_numpy(value), rtol=0, atol=0, msg=name)
    q = state["model.layers.0.self_attn.q_proj.weight"]
    permuted = torch.from_numpy(llama_cpp_permute(expected["model.layers.0.self_attn.q_proj.weight"], 4))
    assert not torch.equal(q, permuted)  # the check above would catch a loader that skipped the un-permute


def test_gguf_is_loaded_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RETROFIT_CACHE", str(tmp_path / "cache"))
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    model, tok = load_any(path)
    assert type(model).__name__ == "LlamaForCausalLM" and tok is not None
    assert model.config._name_or_path == str(path)  # recorded as the base of a conversion
    assert not hasattr(model.config, "quantization_config")  # a plain, serialisable model
    cached = list((cache_root() / "gguf").iterdir())
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file() and (cached[0] / "tokenizer.json").is_file()
    again, _ = load_any(path)  # from the safetensors copy
    sa, sb = model.state_dict(), again.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    convert(again, ConversionSpec(window=4, latents=4))
    with torch.no_grad():
        assert torch.isfinite(again(torch.randint(0, 64, (1, 12))).logits).all()


def test_unknown_inputs(tmp_path):
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not a .gguf"):
        load_any(tmp_path / "weights.txt")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_any(tmp_path)
    with pytest.raises(CheckpointError, match="cannot load 'no-such-org/no-such-model'"):
        load_any("no-such-org/no-such-model")  # hub offline in tests
