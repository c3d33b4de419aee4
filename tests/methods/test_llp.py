"""``--method llp``: conversion of every family, exactness against an independent mask reference,
cached decoding, batching with padding, LoRA training through PEFT."""
from __future__ import annotations

import pytest
import torch

import retrofit
from retrofit.errors import SpecError
from retrofit.layers.llp import LLPAttention, LLPLayerCache
from retrofit.surgery import ConversionSpec, convert, new_parameter_names
from retrofit.train import train
from retrofit.train.recipe import recipe_from_dict
from tests.methods._common import (
    FAMILIES, assert_generate_batched_equals_single, batch, decode_logits, pattern_reference, saved_weights, tiny_model,
)
from tests.train import tiny


def _llp_pattern(segment):
    h = segment // 2
    return lambda qr, kr: (kr <= qr) & (torch.div(kr, h, rounding_mode="floor") >= torch.div(qr, h, rounding_mode="floor") - 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_equals_original_under_the_llp_mask(family):
    base = tiny_model(family)
    ref = pattern_reference(base, _llp_pattern(10))
    keys_before = set(base.state_dict())
    model = convert(base, ConversionSpec(method="llp", options={"segment": 10}))
    assert set(model.state_dict()) == keys_before  # no new weights, same names
    assert all(isinstance(l.self_attn, LLPAttention) for l in model.model.layers)
    assert new_parameter_names(model) == [] and not any(p.requires_grad for p in model.parameters())
    assert model.config.retrofit["method"] == "llp" and model.config.retrofit["segment"] == 10
    assert "options" not in model.config.retrofit  # method keys are flat in the record

    ids, mask, pos = batch(T=33)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=2e-4)

    # prefill + token-by-token decoding through the model's cache equals the full forward
    dec, cache = decode_logits(model, ids, mask, pos, prefill=7)
    torch.testing.assert_close(dec[real], got[real], atol=2e-4, rtol=2e-4)
    layer = cache.layers[0]
    assert isinstance(layer, LLPLayerCache) and layer.get_seq_length() == 33
    assert layer.buffered <= 10 - 1 + 5  # previous + current half-segment (+ the padded columns)


def test_segment_longer_than_the_text_is_the_original_model():
    base = tiny_model("llama")
    ids, mask, pos = batch(T=20)
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = convert(base, method="llp", options={"segment": 64})(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-4, rtol=2e-4)


def test_left_padded_batch_equals_rows_alone_and_cache_stays_bounded():
    model = convert(tiny_model("gemma2"), method="llp", options={"segment": 8})
    ids, mask, pos = batch(T=40, left_pad=(0, 9))
    dec, cache = decode_logits(model, ids, mask, pos, prefill=12)
    for b, pad in enumerate((0, 9)):
        alone, _ = decode_logits(model, ids[b : b + 1, pad:], mask[b : b + 1, pad:], pos[b : b + 1, pad:], prefill=3)
        torch.testing.assert_close(dec[b, pad:], alone[0], atol=2e-4, rtol=2e-4)
    bytes_40 = cache.layers[1].memory_bytes()
    ids2, mask2, pos2 = batch(T=80, left_pad=(0, 9))
    _, cache2 = decode_logits(model, ids2, mask2, pos2, prefill=12)
    assert cache2.layers[1].memory_bytes() <= bytes_40  # constant in the context length


def test_generate_runs_and_batched_equals_single():
    model = convert(tiny_model("qwen2"), method="llp", options={"segment": 6})
    assert_generate_batched_equals_single(model, T=12, pad=4, max_new_tokens=10)


def test_lora_via_peft_trains_the_projections_only():
    peft = pytest.importorskip("peft")
    model = convert(tiny_model("gemma3"), method="llp", options={"segment": 8})
    model.train()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # the LLP layers kept their pattern with LoRA-wrapped projections inside
    assert isinstance(lora.base_model.model.model.layers[0].self_attn, LLPAttention)
    ids, mask, _ = batch(T=24)
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = lora(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("segment", [7, 0, "512"])
def test_bad_segment_is_a_spec_error(segment):
    with pytest.raises(SpecError, match="segment"):
        convert(tiny_model("llama"), method="llp", options={"segment": segment})


def test_unknown_option_is_a_spec_error():
    with pytest.raises(SpecError, match="segment"):
        ConversionSpec(method="llp", options={"segement": 512})


# ---------------------------------------------------------------------- through retrofit.train (ZeRO-2, one CPU rank)
def test_llp_trains_lora_adapters_and_exports_a_merged_model(train_inputs, tmp_path):
    base_dir, books = train_inputs
    conversion = {"method": "llp", "options": {"segment": 16}}
    recipe = recipe_from_dict(tiny.recipe_dict(
        base_dir, books, tmp_path / "run", conversion=conversion,
        trainable={"mode": "lora", "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
        train={"max_steps": 2, "lr": 1e-2, "gradient_checkpointing": False}, checkpoint={"save_every": 2}, eval={"sequences": 0},
    ))
    result = train(recipe)
    before, after = tiny.base_model().state_dict(), saved_weights(result.final_dir)
    assert set(after) == set(before)  # no new weights; LoRA merged back into the projections
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed)
    loaded = retrofit.load(result.final_dir)
    assert isinstance(loaded.model.layers[1].self_attn, LLPAttention) and loaded.config.retrofit["segment"] == 16
