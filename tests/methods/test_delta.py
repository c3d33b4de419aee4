"""``--method delta``: the layer (pretrained weights shared by name, only the memory's weights new
and trainable, the initial window share exact), equal to the dense references of its two branches
on the patch's q, k, v; closed, it is the window-with-sinks anchor; its decoding cache carries the
memory across prefill chunks and single steps, in slots and in the general path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retrofit.layers import DeltaAttention
from retrofit.ops import delta_rule_reference, repeat_kv_heads, sliding_window_attention_reference
from retrofit.patches import get_patch
from retrofit.surgery import convert, new_parameter_names
from tests.methods._common import assert_closed_is_the_window_with_sinks, perturb_new_weights, attention_inputs, batch, pattern_reference, tiny_model
from tests.methods._common import stepwise_logits as _steps

W = 6
MEMORY = {"memory_gate", "memory_beta", "memory_decay", "memory_query_map", "memory_key_map"}


def _convert(family="llama", **options):
    return convert(tiny_model(family), method="delta", window=W, options=options)


@pytest.mark.parametrize("family", ["llama", "phi3"])  # phi3: a fused qkv_proj
def test_only_the_memory_is_new_and_trainable(family):
    model = tiny_model(family)
    before = dict(model.state_dict())
    originals = {n: getattr(model.model.layers[0].self_attn, n) for n in get_patch(model).submodule_names}
    convert(model, method="delta", window=W)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, DeltaAttention)
    assert all(getattr(attn, n) is m for n, m in originals.items())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    added = sorted(set(after) - set(before))
    assert added == sorted(new_parameter_names(model))
    assert {k.split("self_attn.")[1].split(".")[0] for k in added} == MEMORY
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == added


@pytest.mark.parametrize("share", [0.9, 0.3])
def test_initial_window_share_and_half_life_are_exact(share):
    model = _convert(init_swa_share=share, memory_half_life=100)
    x, _ = attention_inputs(model)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        mix, lat, tail = attn.mixing_logits(x, None, None)
        a = torch.sigmoid(attn.memory_decay(x))
    assert lat is None and tail is None and mix.shape == (2, 4, 37, 2)
    p0 = torch.softmax(mix, -1)[..., 0]
    torch.testing.assert_close(p0, torch.full_like(p0, share))
    torch.testing.assert_close(a ** 100, torch.full_like(a, 0.5))


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: GQA + attention softcap
def test_layer_equals_the_dense_references_of_its_branches(family):
    """o_proj(p0 * SWA_reference + p1 * delta_rule_reference(normalise(M_q q), normalise(M_k k), v,
    sigmoid(beta), logsigmoid(decay))) with trained-looking new weights and left padding."""
    model = _convert(family, memory_half_life=50)
    x, pe = attention_inputs(model)
    patch = get_patch(model)
    attn = model.model.layers[0].self_attn
    perturb_new_weights(model)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :5] = False
    with torch.no_grad():
        got, _ = attn(x, position_embeddings=pe, attention_mask=mask)
        q, k, v = patch.project_qkv(attn, x, pe)
        H = q.shape[1]
        p1 = torch.sigmoid(-attn.memory_gate(x)).transpose(1, 2)[..., None]
        swa = sliding_window_attention_reference(q, k, v, W, scaling=patch.scaling(attn), softcap=patch.softcap(attn),
                                                 key_padding_mask=mask)
        mq = F.normalize(torch.einsum("bhtd,hed->bhte", q, attn.memory_query_map.weight), dim=-1)
        mk = F.normalize(torch.einsum("bhtd,hed->bhte", repeat_kv_heads(k, H), attn.memory_key_map.weight), dim=-1)
        beta = torch.sigmoid(attn.memory_beta(x)).transpose(1, 2)
        g = F.logsigmoid(attn.memory_decay(x)).transpose(1, 2)
        memory, _ = delta_rule_reference(mq, mk, repeat_kv_heads(v, H), beta, g, key_padding_mask=mask)
        expected = patch.project_out(attn, (1 - p1) * swa + p1 * memory)
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-4, atol=1e-5)


def test_closed_memory_is_the_window_with_sinks_anchor():
    """Closed, every layer is the w-token window plus 2 sinks, whatever its trained weights; open, it is not."""
    assert_closed_is_the_window_with_sinks("delta", W, {}, perturb_new_weights)


def test_init_share_one_starts_closed():
    base = tiny_model("llama")
    ref = pattern_reference(base, lambda qr, kr: (kr <= qr) & (kr > qr - W))
    model = convert(base, method="delta", window=W, options={"init_swa_share": 1.0})
    ids, mask, pos = batch(T=25)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-4, rtol=2e-4)


def test_only_new_weights_get_gradients_and_window_dropout_leaves_the_memory_alone():
    model = _convert("qwen2", sinks=1)
    model.train()
    ids = torch.randint(3, 256, (2, 20))
    model(ids, labels=ids).loss.backward()
    new = set(new_parameter_names(model))
    for n, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) if n in new else p.grad is None, n
    attn = model.model.layers[0].self_attn
    assert attn.supports("window_dropout")
    attn.window_dropout = 1.0
    x = torch.randn(2, 9, model.config.hidden_size)
    mix, _, _ = attn.mixing_logits(x, None, None)
    assert torch.equal(torch.softmax(mix, -1)[..., 1], torch.ones(2, 4, 9))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("slots", [True, False])
def test_decoding_through_the_cache_equals_one_forward(family, slots):
    """A prefill, single steps, a 5-token chunk, then steps again: the memory state and the window
    travel through the cache; left-padded rows and a padded token while decoding."""
    model = _convert(family, sinks=2, memory_half_life=30, chunk_size=4)
    perturb_new_weights(model, scale=0.3)
    ids = torch.randint(3, 256, (2, 50))
    mask = torch.ones(2, 50, dtype=torch.long)
    mask[1, :4] = 0
    mask[0, 40] = 0
    with torch.no_grad():
        whole = model(ids, attention_mask=mask).logits
    got, cache = _steps(model, ids, mask, 17, slots=slots, chunk_after=31)
    real = mask.bool()
    torch.testing.assert_close(got[real], whole[real], rtol=1e-4, atol=1e-4)
    assert cache.layers[0].state.memory.shape == (2, 4, 16, 16)
