"""``--method hedgehog``: the layer (pretrained weights shared by name, only the feature maps and the
scale new and trainable) equals the one-normalisation formula written densely on the patch's q, k,
v; closed, it is the window-with-sinks anchor; its decoding cache carries the read beyond the
window across prefill chunks and single steps; it trains and round-trips through checkpoints."""
from __future__ import annotations

import pytest
import torch

from retrofit.errors import SpecError
from retrofit.layers import HedgehogAttention
from retrofit.ops import repeat_kv_heads, rope_rotate
from retrofit.patches import get_patch
from retrofit.surgery import convert, new_parameter_names
from retrofit.surgery.probe import closed_latent_path
from tests.methods._common import (
    assert_closed_is_the_window_with_sinks, assert_generate_batched_equals_single, attention_inputs, perturb_new_weights,
    tiny_model,
)
from tests.methods._common import stepwise_logits as _steps

W = 6


def tiny_model_macchiato():
    return convert(tiny_model("llama"), method="macchiato", window=W, options={"latents": 8})
NEW = {"feature_query", "feature_key", "memory_scale"}


def _convert(family="llama", **options):
    return convert(tiny_model(family), method="hedgehog", window=W, options={"features": 8, **options})


@pytest.mark.parametrize("family", ["llama", "phi3"])  # phi3: a fused qkv_proj
def test_only_the_read_is_new_and_trainable(family):
    model = tiny_model(family)
    before = dict(model.state_dict())
    convert(model, method="hedgehog", window=W, options={"features": 8, "init_log_scale": -1.5})
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, HedgehogAttention)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    added = sorted(set(after) - set(before))
    assert added == sorted(new_parameter_names(model))
    assert {k.split("self_attn.")[1].split(".")[0] for k in added} == NEW
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == added
    assert attn.feature_query.weight.shape == (attn.num_heads, 8, attn.head_dim)
    assert torch.equal(attn.feature_query.weight, attn.feature_key.weight)
    assert torch.equal(attn.memory_scale.bias, torch.full_like(attn.memory_scale.bias, -1.5))
    assert not attn.memory_scale.weight.any() and not attn.memory_scale.count_weight.any()


def _dense_expected(attn, patch, x, pe, mask, sinks, distance=None):
    """o_proj((sum_win e^s v + e^c sum_beyond phi_q.phi_k v) / (sum_win e^s + e^c sum_beyond phi_q.phi_k)),
    the window holding the last W real tokens and the first ``sinks`` real ones, in float64. With
    ``distance``, the read's queries and keys are the pre-RoPE ones at positions ``distance`` and 0."""
    q, k, v = patch.project_qkv(attn, x, pe)
    H = q.shape[1]
    q, k, v = q.double(), repeat_kv_heads(k, H).double(), repeat_kv_heads(v, H).double()
    T = q.shape[2]
    mq, mk = q, k
    if distance is not None:  # attention_inputs puts every row at positions 0..T-1
        pre_q, pre_k = (rope_rotate(x, -torch.arange(T), attn.rope_inv_freq) for x in (q, k))
        mq, mk = rope_rotate(pre_q, torch.full((T,), distance), attn.rope_inv_freq), pre_k
    s = (q @ k.transpose(-1, -2)) * patch.scaling(attn)
    if patch.softcap(attn):
        s = torch.tanh(s / patch.softcap(attn)) * patch.softcap(attn)
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    rank = mask.long().cumsum(1) - 1  # (B, T): real tokens' ranks (the window is index-based: no padding inside)
    causal = (j <= t)[None] & mask[:, None, :]
    window = causal & (j > t - W)[None]
    sink = causal & (rank[:, None, :] < sinks)
    softmax_keys = window | sink
    beyond = causal & ~softmax_keys
    zq = torch.einsum("bhtd,hfd->bhtf", mq, attn.feature_query.weight.double())
    zk = torch.einsum("bhtd,hfd->bhtf", mk, attn.feature_key.weight.double())
    phi_q = torch.cat([zq.softmax(-1), (-zq).softmax(-1)], -1)
    phi_k = torch.cat([zk.softmax(-1), (-zk).softmax(-1)], -1)
    kappa = (phi_q @ phi_k.transpose(-1, -2)) * beyond[:, None]
    n = beyond.double().sum(-1).clamp_min(1)[:, None]  # (B, 1, T) keys in the memory
    c = (torch.einsum("bhtd,hd->bht", mq, attn.memory_scale.weight.double()) + attn.memory_scale.bias.double()[:, None]
         + attn.memory_scale.count_weight.double()[:, None] * n.log())
    e = s.masked_fill(~softmax_keys[:, None], float("-inf"))
    m = e.amax(-1, keepdim=True)
    num = (e - m).exp() @ v + (c[..., None] - m).exp() * (kappa @ v)
    den = (e - m).exp().sum(-1, keepdim=True) + (c[..., None] - m).exp() * kappa.sum(-1, keepdim=True)
    return patch.project_out(attn, (num / den).to(x.dtype))


@pytest.mark.parametrize("family,sinks,distance", [("llama", 0, None), ("llama", 2, None), ("gemma2", 1, None),
                                                    ("llama", 2, 9), ("qwen2", 0, 0)])  # gemma2: GQA + softcap
def test_layer_equals_one_normalisation_over_window_sinks_and_read(family, sinks, distance):
    model = _convert(family, sinks=sinks, sink_distance=0, memory_distance=distance)
    x, pe = attention_inputs(model)
    patch = get_patch(model)
    attn = model.model.layers[0].self_attn
    perturb_new_weights(model)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :5] = False
    with torch.no_grad():
        got, _ = attn(x, position_embeddings=pe, attention_mask=mask)
        want = _dense_expected(attn, patch, x, pe, mask, sinks, distance)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-5)
    assert (got[~mask] == 0).all()


def test_closed_read_is_the_window_with_sinks_anchor():
    """Closed, every layer is the w-token window plus 2 sinks, whatever its trained weights; open, it is not."""
    assert_closed_is_the_window_with_sinks("hedgehog", W, {"features": 8}, perturb_new_weights)


def test_only_new_weights_get_gradients():
    model = _convert("qwen2", sinks=1)
    model.train()
    ids = torch.randint(3, 256, (2, 20))
    model(ids, labels=ids).loss.backward()
    new = set(new_parameter_names(model))
    for n, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) if n in new else p.grad is None, n
    assert not model.model.layers[0].self_attn.supports("window_dropout")


@pytest.mark.parametrize("slots", [True, False])
@pytest.mark.parametrize("family,distance,prefill", [
    ("llama", None, 17), ("gemma2", None, 17), ("llama", 7, 17), ("llama", 7, 3), ("gemma2", None, 3)])
def test_decoding_through_the_cache_equals_one_forward(family, distance, prefill, slots):
    """A prefill, single steps, a 5-token chunk, then steps again, through the decoding slots (the
    key leaving the window moved into the state each step) or the general path: the state of the
    keys beyond the window and the window travel through the cache (with ``memory_distance``, the
    cached keys rotated back from the new tokens' positions); a left-padded row and a padded token
    while decoding. A prefill shorter than the window: the first steps fill the window's ring,
    with no key leaving it yet."""
    model = _convert(family, sinks=2, chunk_size=4, memory_distance=distance)
    perturb_new_weights(model, scale=0.3)
    ids = torch.randint(3, 256, (2, 50))
    mask = torch.ones(2, 50, dtype=torch.long)
    if prefill > W:  # a left-padded row (with it, the slots wait for its sinks, past the window's filling)
        mask[1, :4] = 0
    mask[0, 40] = 0
    with torch.no_grad():
        whole = model(ids, attention_mask=mask).logits
    got, cache = _steps(model, ids, mask, prefill, slots=slots, chunk_after=31)
    real = mask.bool()
    torch.testing.assert_close(got[real], whole[real], rtol=1e-4, atol=1e-4)
    attn = model.model.layers[0].self_attn
    assert cache.layers[0].state.S.shape == (2, attn.num_heads, 16, attn.head_dim)


def _trained_looking_layer(family: str, cap: int, **options):
    """The first layer of a converted tiny model with perturbed new weights and the teacher's RoPE
    cap at ``cap``, its inputs ``x (2, 37, C)`` and ``(cos, sin)``, and a mask whose second row is
    left-padded by 5."""
    model = _convert(family, **options)
    x, pe = attention_inputs(model)
    attn = model.model.layers[0].self_attn
    attn.teacher_rope_cap = cap
    perturb_new_weights(model)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :5] = False
    return attn, x, pe, mask


@pytest.mark.parametrize("family,sinks,distance,cap,sink_distance", [
    ("llama", 2, None, 0, 0), ("gemma2", 1, None, 0, 0), ("llama", 2, 9, 0, 0),
    ("llama", 2, 9, 20, 15), ("llama", 2, None, 13, 0), ("gemma2", 1, None, 20, 25)])
def test_attention_weights_are_the_layers_and_the_pretrained_softmaxs(family, sinks, distance, cap, sink_distance):
    """The distributions the weights objective compares are the real ones: the student's weights
    times the values are the layer's output, the teacher's the pretrained attention's (left padding,
    sinks, GQA + softcap, ``memory_distance``; past the teacher's RoPE cap, the capped attention,
    and sinks at the layer's own ``sink_distance``)."""
    attn, x, pe, mask = _trained_looking_layer(family, cap, sinks=sinks, sink_distance=sink_distance,
                                               memory_distance=distance)
    rows = torch.tensor([6, 11, 20, 36])
    with torch.no_grad():
        got, _ = attn(x, position_embeddings=pe, attention_mask=mask)
        base = attn.original_attention(x, pe, mask)
        teacher, student, values = attn.attention_distributions(x, pe, mask, rows)
    assert torch.allclose(student.exp().sum(-1), torch.ones(())) and torch.allclose(teacher.exp().sum(-1), torch.ones(()))
    for dist, want in ((student, got), (teacher, base)):
        out = attn.patch.project_out(attn, (dist.exp() @ values.float()).to(x.dtype))
        torch.testing.assert_close(out, want[:, rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family,sinks,distance,cap", [
    ("llama", 2, None, 0), ("gemma2", 1, None, 0), ("llama", 2, 9, 0), ("llama", 0, 9, 0), ("llama", 2, 9, 13)])
def test_fit_terms_are_the_layers_own_distributions(family, sinks, distance, cap):
    """What ``retrofit fit`` fits is the layer's real read: ``read_kl`` is the KL between the
    teacher's and the layer's weights renormalised over the keys beyond the window (left padding,
    GQA + softcap, ``memory_distance``, a capped teacher), and the scale's least-squares problem is
    written so that its residual ``y - x . [a, b, g]`` is the gap between the teacher's and the
    layer's share beyond the window, in logits (where both score the window alike: no cap, no
    native window)."""
    attn, x, pe, mask = _trained_looking_layer(family, cap, sinks=sinks, memory_distance=distance)
    rows = torch.tensor([3, 6, 11, 20, 36])  # row 3 (and row 6 of the padded sequence) has no key beyond the window
    with torch.no_grad():
        teacher, student, _ = attn.attention_distributions(x, pe, mask, rows)
        got_kl = attn.read_kl(x, pe, mask, rows)
        inp, y, ok = attn.scale_regression(x, pe, mask, rows)
    j, real = torch.arange(37), mask
    sink = real & (real.long().cumsum(-1) <= sinks)
    read = (j[None, :] <= rows[:, None] - W)[None, None] & (real & ~sink)[:, None, None, :]  # older than the window
    memory = read & teacher.isfinite()  # (B, H, R, T): and seen by the teacher (a native window sees fewer)

    def beyond(logw, keys):  # log-weights renormalised over the keys beyond the window
        lw = logw.masked_fill(~keys, float("-inf"))
        return lw - lw.logsumexp(-1, keepdim=True)

    t, st = beyond(teacher, memory), beyond(student, read)
    kl = torch.where(memory, t.exp() * (t - st), 0.0).sum(-1)  # (B, H, R)
    has = memory.any(-1).float()
    torch.testing.assert_close(got_kl, (kl * has).sum((0, 2)) / has.sum((0, 2)), rtol=1e-4, atol=1e-6)
    assert has[:, 0].eq(ok.float()).all() and not ok[:, 0].any() and ok[0, -1]
    assert (got_kl > 0).all()
    if cap or attn.native_window:  # the teacher would score (or see) the window and sinks unlike the layer
        return
    s = attn.memory_scale
    coef = torch.cat([s.weight, s.bias[:, None], s.count_weight[:, None]], dim=1)

    def logit(log_share):
        return log_share - torch.log1p(-log_share.exp())

    share_t = teacher.masked_fill(~memory, float("-inf")).logsumexp(-1)
    share_s = student.masked_fill(~read, float("-inf")).logsumexp(-1)
    gap = (y - (inp @ coef[..., None])[..., 0]).permute(0, 2, 1)[ok]  # (rows, H)
    torch.testing.assert_close(gap, (logit(share_t) - logit(share_s)).permute(0, 2, 1)[ok], rtol=1e-4, atol=1e-4)
    attn.set_memory_scale(coef + 1.0)
    torch.testing.assert_close(s.count_weight, coef[:, -1] + 1.0)
    with pytest.raises(ValueError, match="coefficients"):
        attn.set_memory_scale(coef[:, :-1])


def test_attention_weights_loss_trains_only_the_read_and_falls():
    """``train.objective: weights``'s per-layer term: KL >= 0, gradients on the new weights only, and a
    few Adam steps on it lower it."""
    from retrofit.surgery.distill import distill_mode, transfer_losses

    model = _convert("llama", sinks=2, memory_distance=6)
    ids = torch.randint(3, 256, (2, 40))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    losses = []
    for _ in range(15):
        with distill_mode(model, "weights", queries=16):
            model(ids, logits_to_keep=1)
            loss = torch.stack(transfer_losses(model)).sum()
        opt.zero_grad()
        loss.backward()
        losses.append(float(loss))
        opt.step()
    assert all(x >= 0 for x in losses) and losses[-1] < 0.8 * losses[0], losses
    new = set(new_parameter_names(model))
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in new), n
    with pytest.raises(SpecError, match="hedgehog"):
        with distill_mode(tiny_model_macchiato(), "weights"):
            pass


def test_generate_batched_equals_single():
    """``generate`` numbers a left-padded row's positions from its first real token; the position-free
    read rotates cached keys back from the new token's position, which must agree."""
    model = _convert("llama", sinks=2, memory_distance=5)
    perturb_new_weights(model, scale=0.3)
    assert_generate_batched_equals_single(model, T=20, pad=5, max_new_tokens=12)


def test_bad_options_are_spec_errors():
    with pytest.raises(SpecError, match="features"):
        _convert(features=0)
    with pytest.raises(SpecError, match="init_log_scale"):
        _convert(init_log_scale=float("inf"))
    with pytest.raises(SpecError, match="memory_distance"):
        _convert(memory_distance=-1)


@pytest.mark.parametrize("distance", [None, 5])
def test_memory_distance_makes_the_layer_blind_to_absolute_position(distance):
    """Every score then depends on distances only (the window's on its own, the read's on none): the
    same tokens at positions 0.. and 1000.. give the same output; with true distances the read's
    features see the rotation and they do not."""
    model = _convert("llama", sinks=1, sink_distance=0, memory_distance=distance)
    perturb_new_weights(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 30, model.config.hidden_size)
    outs = []
    with torch.no_grad():
        for start in (0, 1000):
            pe = model.model.rotary_emb(x, torch.arange(start, start + 30)[None])
            outs.append(attn(x, position_embeddings=pe)[0])
    if distance is None:
        assert not torch.allclose(outs[0], outs[1], atol=1e-3)
    else:
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_a_cache_filled_with_the_read_closed_refuses_to_continue_open():
    """Closed, the layer keeps no memory of the keys leaving its window; reopening on that cache
    would silently read nothing of them, so it raises instead."""
    from retrofit.layers.cache import RetrofitCache

    model = _convert("llama", memory_distance=4)
    ids = torch.randint(3, 256, (1, 20))
    cache = RetrofitCache(model)
    with torch.no_grad():
        with closed_latent_path(model):
            model(ids[:, :12], past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="start a new cache"):
            model(ids[:, 12:], past_key_values=cache, use_cache=True)
