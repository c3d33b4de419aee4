"""The "retrofit" mask function traces without a graph break, and its all-True compiled mask is exact."""
from __future__ import annotations

import torch

from retrofit.patches.attention import retrofit_mask
from retrofit.surgery import ConversionSpec, convert

from ..surgery.tiny import tiny_model


def test_mask_function_compiles_with_fullgraph():
    fn = torch.compile(retrofit_mask, fullgraph=True, backend="eager")  # a graph break would raise
    full = fn(2, 5, 5, attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert full.dtype == torch.bool and bool(full.all())
    padded = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert torch.equal(fn(2, 5, 5, attention_mask=padded), padded.bool())
    assert retrofit_mask(2, 5, 5, attention_mask=torch.ones(2, 5)) is None  # eager: the fast path


def test_all_true_mask_equals_no_mask():
    """What the compiled path hands the layers (an all-True 2D mask) gives the same logits as None."""
    model = convert(tiny_model("gemma3"), ConversionSpec(window=8, latents=8))
    with torch.no_grad():
        layers = [m for m in model.modules() if getattr(m, "is_retrofit_attention", False)]
        out = layers[0].forward  # run the layers with an explicit all-True 2D mask
        hidden = torch.randn(2, 30, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
        pe = model.model.rotary_emb(hidden, torch.arange(30)[None], layer_type="sliding_attention")
        a = out(hidden, position_embeddings=pe, attention_mask=None)[0]
        b = out(hidden, position_embeddings=pe, attention_mask=torch.ones(2, 30, dtype=torch.bool))[0]
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
