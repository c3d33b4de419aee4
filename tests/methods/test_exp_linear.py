"""``--method exp-linear``: the layer equals the dense reference of its op on the patch's q, k, v
(no new weights)."""
from __future__ import annotations

import pytest
import torch

from retrofit.layers import ExpLinearAttention
from retrofit.ops import exp_linear_attention_reference, repeat_kv_heads
from retrofit.patches import get_patch
from retrofit.surgery import ConversionSpec, convert, new_parameter_names
from tests.methods._common import attention_inputs as _attention_inputs
from tests.surgery.tiny import tiny_model


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_exp_linear_layer_equals_reference(family):
    """phi = exp on sqrt(scaling) * (rotated q, k); GQA by repeating k, v over the query group."""
    model = tiny_model(family)
    x, pe = _attention_inputs(model)
    patch = get_patch(model)
    convert(model, ConversionSpec(method="exp-linear", chunk_size=8))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, ExpLinearAttention) and new_parameter_names(model) == []
    with torch.no_grad():
        got, _ = attn(x, position_embeddings=pe)
        q, k, v = patch.project_qkv(attn, x, pe)
        s = patch.scaling(attn) ** 0.5
        H = q.shape[1]
        ref = exp_linear_attention_reference(q * s, repeat_kv_heads(k, H) * s, repeat_kv_heads(v, H))
        expected = patch.project_out(attn, ref)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
