"""Activation checkpointing through retrofit.surgery.recompute: the switch works under both of
transformers' names, and a recomputed backward gives the gradients of a plain one.

Run on the oldest transformers too (scripts/test-oldest.sh), where only the older name exists."""
from __future__ import annotations

import torch

import retrofit
from retrofit.surgery.recompute import set_activation_checkpointing
from tests.surgery.tiny import tiny_model


def _grads(model) -> dict[str, torch.Tensor]:
    model.train()
    ids = torch.randint(3, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _converted():
    model = tiny_model("llama")
    retrofit.convert(model, retrofit.ConversionSpec(method="macchiato", window=16, latents=8, sinks=2))
    return model


def test_recomputed_backward_matches():
    model = _converted()
    plain = _grads(model)
    set_activation_checkpointing(model, True)
    assert model.is_gradient_checkpointing
    recomputed = _grads(model)
    assert plain.keys() == recomputed.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    set_activation_checkpointing(model, False)
    assert not model.is_gradient_checkpointing


class _OlderModel(torch.nn.Module):
    """The switch as transformers 5.13-5.17 offer it: only the gradient_checkpointing_* names
    (newer releases route that name through the new one, so removing the new name from a current
    model would not show the older API)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def gradient_checkpointing_enable(self):
        self.calls.append("enable")

    def gradient_checkpointing_disable(self):
        self.calls.append("disable")


def test_older_name_is_used_when_the_new_one_is_missing():
    model = _OlderModel()
    set_activation_checkpointing(model, True)
    set_activation_checkpointing(model, False)
    assert model.calls == ["enable", "disable"]
