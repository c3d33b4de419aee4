"""The sliced LM head: the model's own next-token loss and gradients without (B, T, V) logits."""
from __future__ import annotations

import pytest
import torch

from retrofit.surgery import ConversionSpec, convert
from retrofit.surgery.lm_head import sliced_head_terms, sliced_lm_loss
from tests.surgery.tiny import FAMILIES, tiny_model

T = 33  # not a multiple of the slice below: the last slice is short and holds the target-less position


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("converted", [False, True])
def test_sliced_lm_loss_is_the_models_own_loss_and_gradient(family, converted):
    model = tiny_model(family)
    if converted:
        model = convert(model, ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    else:
        model.requires_grad_(True)
    ids = torch.randint(3, 256, (2, T), generator=torch.Generator().manual_seed(7))
    want = model(input_ids=ids, labels=ids).loss
    want.backward()
    want_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    vocab = model.get_output_embeddings().weight.shape[0]
    got = sliced_lm_loss(model, ids, logit_budget=4 * vocab * ids.shape[0])  # 4 positions per slice
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for n, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[n], atol=1e-5, rtol=1e-4)


def test_kl_of_a_model_to_itself_is_zero_and_terms_are_required():
    model = tiny_model("llama")
    hidden = torch.randn(2, 9, model.config.hidden_size)
    terms = sliced_head_terms(model, hidden, hidden, None, logit_budget=1)
    assert set(terms) == {"kl"} and abs(float(terms["kl"])) < 1e-6
    with pytest.raises(ValueError, match="teacher"):
        sliced_head_terms(model, hidden, None, None)


def test_a_peft_wrapped_head_takes_the_module_slices_with_the_same_loss():
    """A LoRA-wrapped head is no plain nn.Linear: the terms run through the module one slice of
    positions at a time, and still equal the model's own loss and gradients (LoRA's included)."""
    from peft import LoraConfig, get_peft_model

    from retrofit.surgery.lm_head import _plain_linear

    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    assert not _plain_linear(model.get_output_embeddings())
    ids = torch.randint(3, 256, (2, T), generator=torch.Generator().manual_seed(8))
    want = model(input_ids=ids, labels=ids).loss
    want.backward()
    want_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    got = sliced_lm_loss(model, ids, logit_budget=5 * 256 * ids.shape[0])
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys() and any("lora" in n for n in got_grads)
    for n, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[n], atol=1e-5, rtol=1e-4)


def test_a_plain_head_takes_the_tiled_op(monkeypatch):
    """The tiled op is what runs for a plain linear head (so the test above is the only slice path)."""
    import retrofit.surgery.lm_head as lm_head

    calls = []
    real = lm_head.linear_head_losses
    monkeypatch.setattr(lm_head, "linear_head_losses", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = tiny_model("gemma2")  # soft-capped head
    ids = torch.randint(3, 256, (1, T), generator=torch.Generator().manual_seed(9))
    got = sliced_lm_loss(model, ids, logit_budget=3 * 256)
    assert len(calls) == 1 and calls[0]["softcap"] == model.config.final_logit_softcapping
    assert calls[0]["vocab_block"] == 256 and calls[0]["token_block"] == 3
    assert float(got.detach()) == pytest.approx(float(model(input_ids=ids, labels=ids).loss), rel=1e-5)
