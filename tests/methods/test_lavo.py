"""``--method lavo``: conversion of every family, the sliding-window anchor against an independent
reference, cached decoding, batching with padding, and that the new weights train."""
from __future__ import annotations

import pytest
import torch

import retrofit
from retrofit.errors import SpecError
from retrofit.layers.lavo import LavoAttention, LavoLayerCache
from retrofit.surgery import ConversionSpec, convert, new_parameter_names
from retrofit.train import train
from retrofit.train.recipe import recipe_from_dict
from tests.methods._common import (
    FAMILIES, assert_generate_batched_equals_single, batch, decode_logits, pattern_reference, perturb_new_weights,
    saved_weights, tiny_model,
)
from tests.train import tiny

W = 8


def _window(w):
    return lambda qr, kr: (kr <= qr) & (kr > qr - w)


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_anchor_and_decoding(family):
    base = tiny_model(family)
    ref = pattern_reference(base, _window(W))
    keys_before = set(base.state_dict())
    anchor = convert(
        tiny_model(family), method="lavo", window=W,
        options={"global_weight": 0.0, "learn_global_weight": False, "bases": 8},
    )
    model = convert(base, method="lavo", window=W, options={"bases": 8})

    # new weights: exactly bases / rel_bias / gate per layer, the only trainable ones
    new = new_parameter_names(model)
    assert sorted(new) == sorted(f"model.layers.{i}.self_attn.lavo.{n}" for i in range(2) for n in ("bases", "rel_bias", "gate"))
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(new)
    assert set(model.state_dict()) == keys_before | set(new)
    layer = model.model.layers[0].self_attn
    assert isinstance(layer, LavoAttention) and layer.num_bases == 8
    bases = layer.lavo.bases.detach()
    torch.testing.assert_close(bases @ bases.transpose(1, 2), torch.eye(8).expand(4, 8, 8), atol=1e-5, rtol=0)
    assert torch.sigmoid(layer.lavo.gate).allclose(torch.full((4,), 0.5))

    ids, mask, pos = batch(T=30)
    real = mask.bool()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got_anchor = anchor(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    # g = 0 and zero bias: exactly the pretrained model with a w-token sliding window
    torch.testing.assert_close(got_anchor[real], want[real], atol=2e-4, rtol=2e-4)
    # g = 1/2: the first window is pure local attention in layer 0, later tokens see the memory
    assert not torch.allclose(got[real], want[real], atol=1e-2)

    dec, cache = decode_logits(model, ids, mask, pos, prefill=5)
    torch.testing.assert_close(dec[real], got[real], atol=2e-4, rtol=2e-4)
    entry = cache.layers[1]
    assert isinstance(entry, LavoLayerCache) and entry.get_seq_length() == 30
    assert entry.buffered == W - 1 and entry.state.seen.tolist() == [30, 25]


def test_left_padded_batch_equals_rows_alone_and_memory_is_constant():
    model = convert(tiny_model("llama"), method="lavo", window=W, options={"bases": 4})
    ids, mask, pos = batch(T=40, left_pad=(0, 7))
    dec, cache = decode_logits(model, ids, mask, pos, prefill=9)
    for b, pad in enumerate((0, 7)):
        alone, _ = decode_logits(model, ids[b : b + 1, pad:], mask[b : b + 1, pad:], pos[b : b + 1, pad:], prefill=2)
        torch.testing.assert_close(dec[b, pad:], alone[0], atol=2e-4, rtol=2e-4)
    ids2, mask2, pos2 = batch(T=90, left_pad=(0, 7))
    _, cache2 = decode_logits(model, ids2, mask2, pos2, prefill=9)
    assert cache2.layers[0].memory_bytes() == cache.layers[0].memory_bytes()


def test_generate_batched_equals_single():
    model = convert(tiny_model("gemma3"), method="lavo", window=W)
    assert_generate_batched_equals_single(model, T=14, pad=3, max_new_tokens=12)


def test_only_new_weights_get_gradients_and_loss_drops():
    model = convert(tiny_model("gemma2"), method="lavo", window=W, options={"bases": 8})
    model.train()
    ids, mask, _ = batch(T=40)
    labels = ids.masked_fill(mask == 0, -100)
    new = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(new.values(), lr=3e-2)
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in new.values())
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_undissected_memory_and_options_reach_the_layer():
    model = convert(
        tiny_model("mistral"), method="lavo", window=4,
        options={"dissect": False, "relative_bias": False, "memory_scaling": 2.0, "global_weight": 0.2},
    )
    layer = model.model.layers[1].self_attn
    assert not layer.dissect and layer.lavo.rel_bias is None and layer.memory_scaling == 2.0
    assert layer.num_bases == 16  # min(64, head_dim)
    assert "lavo.rel_bias" not in layer.new_parameter_names()
    ids, mask, pos = batch(T=17)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    dec, _ = decode_logits(model, ids, mask, pos, prefill=1)
    torch.testing.assert_close(dec[mask.bool()], full[mask.bool()], atol=2e-4, rtol=2e-4)


def test_a_fixed_gate_without_a_bias_survives_save_and_load(tmp_path):
    """The options the generic tests (test_every_method.py) leave at their defaults: a gate that is a
    buffer, not a weight, and no relative bias come back from full and delta checkpoints."""
    from retrofit.surgery import load, load_delta, save, save_delta

    tiny_model("gemma2").save_pretrained(tmp_path / "base")
    model = convert(tiny_model("gemma2"), method="lavo", window=6, base_model=str(tmp_path / "base"),
                    options={"global_weight": 0.3, "learn_global_weight": False, "relative_bias": False})
    perturb_new_weights(model)
    layer = model.model.layers[0].self_attn
    assert layer.lavo.rel_bias is None and "lavo.gate" not in layer.new_parameter_names()
    ids, mask, pos = batch(T=20)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    save(model, tmp_path / "full")
    save_delta(model, tmp_path / "delta", base_model=str(tmp_path / "base"))
    for loaded in (load(tmp_path / "full"), load_delta(tmp_path / "delta")[0]):
        assert loaded.config.retrofit["learn_global_weight"] is False
        with torch.no_grad():
            got = loaded(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"bases": 17}, "bases"),
        ({"bases": 0}, "bases"),
        ({"global_weight": 0.0}, "global_weight"),
        ({"global_weight": 1.0, "learn_global_weight": False}, "global_weight"),
    ],
)
def test_bad_options_are_spec_errors(options, match):
    with pytest.raises(SpecError, match=match):
        convert(tiny_model("llama"), method="lavo", window=W, options=options)
    with pytest.raises(SpecError, match="rank"):
        ConversionSpec(method="lavo", options={"rank": 8})


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_global_query_is_the_query_before_rope(family):
    model = convert(tiny_model(family), method="lavo", window=W)
    layer = model.model.layers[1].self_attn
    x = torch.randn(2, 20, 64)
    pos = torch.arange(20)[None].expand(2, -1)
    rope = model.model.rotary_emb
    cos, sin = rope(x, pos, "full_attention") if family == "gemma3" else rope(x, pos)
    q, k, _ = layer.patch.project_qkv(layer, x, (cos, sin))
    q_raw = layer.q_proj(x).view(2, 20, -1, layer.head_dim).transpose(1, 2)
    want = layer.q_norm(q_raw) if family == "gemma3" else q_raw  # after the q norm, before RoPE
    torch.testing.assert_close(layer.global_query(q, k, (cos, sin)), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(q[:, :, 1:], want[:, :, 1:], atol=1e-3)  # RoPE did rotate


# ---------------------------------------------------------------------- through retrofit.train (ZeRO-2, one CPU rank)
def test_lavo_trains_only_its_new_weights(train_inputs, tmp_path):
    base_dir, books = train_inputs
    conversion = {"method": "lavo", "window": 8, "options": {"bases": 8}}
    recipe = recipe_from_dict(tiny.recipe_dict(
        base_dir, books, tmp_path / "run", conversion=conversion, trainable={"mode": "new"},
        train={"max_steps": 3, "lr": 1e-2, "gradient_checkpointing": True}, checkpoint={"save_every": 3}, eval={"sequences": 0},
    ))
    result = train(recipe)
    initial = retrofit.convert(tiny.base_model(), retrofit.ConversionSpec(**conversion))
    new = set(retrofit.surgery.new_parameter_names(initial))
    assert new and all(".lavo." in n for n in new)
    assert result.counts.trainable == sum(p.numel() for n, p in initial.named_parameters() if n in new)
    before, after = initial.state_dict(), saved_weights(result.final_dir)
    assert set(after) == set(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == new  # bases, relative bias and gate moved; every pretrained tensor is untouched
    loaded = retrofit.load(result.final_dir)
    assert isinstance(loaded.model.layers[0].self_attn, LavoAttention)
