"""Packed documents (position_ids that restart at each document, transformers' packed format) are
attended one document at a time by every converted method and by the softmax layers a conversion
keeps: logits and the new weights' gradients equal each document run alone; a call without
boundaries is the plain path, bit for bit; distillation reads the same documents."""
from __future__ import annotations

import pytest
import torch

from retrofit.layers import available_methods, get_method
from retrofit.layers.documents import DocumentBatch, document_starts, packed_documents
from retrofit.surgery import ConversionSpec, convert
from retrofit.surgery.distill import distill_mode
from tests.methods._common import perturb_new_weights, tiny_model

METHODS = list(available_methods())  # at collection, as tests/methods/test_every_method.py does
FAMILY = "gemma2"  # soft-capping, a sliding layer and a global one, GQA
LENGTHS = ((7, 12, 5), (10, 14))  # documents of each packed row (T = 24)


def _converted(name: str, **kw):
    model = convert(tiny_model(FAMILY), ConversionSpec(method=name, **{**dict(get_method(name).test_spec.options), **kw}))
    perturb_new_weights(model)
    return model


def _packed(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS[0])
    ids = torch.randint(3, 200, (len(LENGTHS), T), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    return ids, pos


def _documents(ids):
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            yield b, start, ids[b : b + 1, start : start + n]
            start += n


def _new_params(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("name", METHODS)
def test_packed_documents_equal_each_document_alone_logits_and_gradients(name):
    model = _converted(name)
    trains = bool(_new_params(model))  # methods without new weights (exp-linear, llp): logits only
    ids, pos = _packed()
    weights = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(5))
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    if trains:
        (packed * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in _new_params(model)}
    model.zero_grad()
    alone = torch.zeros_like(packed)
    for b, start, doc in _documents(ids):
        logits = model(input_ids=doc, use_cache=False).logits
        if trains:
            (logits * weights[b : b + 1, start : start + doc.shape[1]]).sum().backward()
        alone[b, start : start + doc.shape[1]] = logits[0].detach()
    torch.testing.assert_close(packed.detach(), alone, rtol=1e-4, atol=1e-4)
    for n, p in _new_params(model):
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name} {n}: {m}")
    # boundaries matter: without them the later documents read the earlier ones
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids, use_cache=False).logits, alone, atol=1e-3)


@pytest.mark.parametrize("name", METHODS)
def test_a_batch_without_boundaries_is_the_plain_path_bit_for_bit(name):
    model = _converted(name)
    ids, _ = _packed()
    T = ids.shape[1]
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        for pos in (torch.arange(T)[None], torch.arange(T).expand(2, T)):
            assert torch.equal(model(input_ids=ids, position_ids=pos, use_cache=False).logits, plain)
        shifted = torch.arange(5, 5 + T)  # positions that never restart: no boundary either
        assert torch.equal(model(input_ids=ids, position_ids=shifted.expand(2, T), use_cache=False).logits,
                           model(input_ids=ids, position_ids=shifted[None], use_cache=False).logits)

def test_kept_softmax_layers_read_documents_alone_too():
    """A hybrid conversion (layer 1 stays softmax attention under the "retrofit" implementation)."""
    model = _converted("macchiato", layers=[0])
    ids, pos = _packed(1)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        for b, start, doc in _documents(ids):
            alone = model(input_ids=doc, use_cache=False).logits[0]
            torch.testing.assert_close(packed[b, start : start + doc.shape[1]], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["transfer", "weights"])
def test_distillation_reads_documents_alone(mode):
    """The same document packed twice: teacher outputs and every layer's loss are the document's alone."""
    name = "hedgehog" if mode == "weights" else "delta"
    model = _converted(name)
    doc = torch.randint(3, 200, (1, 11), generator=torch.Generator().manual_seed(2))
    twice, pos = torch.cat([doc, doc], 1), torch.arange(11).repeat(2)[None]
    with torch.no_grad(), distill_mode(model, mode) as modules:
        alone_out = model(input_ids=doc, use_cache=False).logits
        alone = [float(m.transfer_loss) for m in modules]
        packed_out = model(input_ids=twice, position_ids=pos, use_cache=False).logits
        packed = [float(m.transfer_loss) for m in modules]
    torch.testing.assert_close(packed_out, torch.cat([alone_out, alone_out], 1), rtol=1e-4, atol=1e-4)
    assert packed == pytest.approx(alone, rel=1e-4, abs=1e-6)


def test_a_cache_with_boundaries_is_refused():
    model = _converted("llp")
    ids, pos = _packed()
    with torch.no_grad(), pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, position_ids=pos, use_cache=True)


def test_document_batch_regroups_and_merges_back():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 7, 8]])
    starts = document_starts(pos, 2, 6)
    assert starts.tolist() == [[False, False, False, True, False, True], [False] * 6]
    docs = DocumentBatch.from_starts(starts)
    assert docs.valid.long().sum(1).tolist() == [3, 2, 1, 6] and docs.valid.shape == (4, 6)
    x = torch.randn(2, 3, 6, 4)  # (B, H, T, d)
    split = docs.split(x, 2)
    assert split.shape == (4, 3, 6, 4) and torch.equal(split[1, :, :2], x[0, :, 3:5])
    assert torch.equal(docs.merge(split, 2), x)
    assert document_starts(torch.arange(6)[None], 2, 6) is None
    assert packed_documents(pos, 2, 6, attention_mask=torch.ones(2, 6)) is None  # padding: no packing read
