"""Causal attention with capped RoPE distances: the blocked forms against the dense reference,
the reference against independent constructions (plain causal attention inside the cap, keys
re-positioned to the cap for one query), forward and backward, padding, bf16, large logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retrofit.ops import capped_rope_attention, capped_rope_attention_reference, rope_rotate
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import attention_inputs, padding_mask

INV_FREQ = 1.0 / (100.0 ** (torch.arange(0, 6, 2, dtype=torch.float32) / 6))  # F = 3 of d = 8: partial rotary


def _inputs(B=2, Hq=4, Hkv=2, Tq=37, Tk=37, d=8, dtype=torch.float64, seed=0, scale=1.0):
    return attention_inputs(B, Hq, Hkv, Tq, Tk, d, dtype=dtype, seed=seed, scale=scale)


def _padding(B, T):
    return padding_mask(B, T, [0, 5])


def _causal(q, k, v, mask=None):
    group = q.shape[1] // k.shape[1]
    Tq, Tk = q.shape[2], k.shape[2]
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


# the split form has no soft-capping (SDPA cannot express it): Gemma 2 layers take the joint form
FORMS = [(False, None), (False, 2.0), (True, None)]


@pytest.mark.parametrize("distance", [1, 3, 10, 36])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("split,softcap", FORMS)
@pytest.mark.parametrize("block_size", [1, 7, 64])
def test_blocked_forms_match_reference(distance, padded, softcap, split, block_size):
    q, k, v = _inputs()
    mask = _padding(2, 37) if padded else None
    ref = capped_rope_attention_reference(q, k, v, distance, INV_FREQ, softcap=softcap, key_padding_mask=mask)
    got = capped_rope_attention(q.float(), k.float(), v.float(), distance, INV_FREQ, softcap=softcap,
                                key_padding_mask=mask, block_size=block_size, split=split)
    torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("q_start", [0, 10, 29])
@pytest.mark.parametrize("split", [False, True])
def test_queries_inside_a_longer_key_set(q_start, split):
    """Chunked prefill: queries at q_start.. of the key stream (later keys unseen by causality)."""
    q, k, v = _inputs(Tq=8, Tk=37)
    mask = _padding(2, 37)
    ref = capped_rope_attention_reference(q, k, v, 5, INV_FREQ, q_start=q_start, key_padding_mask=mask)
    got = capped_rope_attention(q, k, v, 5, INV_FREQ, q_start=q_start, key_padding_mask=mask, block_size=3, split=split)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


def test_inside_the_cap_it_is_causal_attention():
    q, k, v = _inputs()
    mask = _padding(2, 37)
    for distance in (36, 100):  # no pair is farther apart than the cap
        ref = capped_rope_attention_reference(q, k, v, distance, INV_FREQ, key_padding_mask=mask)
        expect = _causal(q, k, v, mask) * mask[:, None, :, None]
        torch.testing.assert_close(ref, expect, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(capped_rope_attention(q, k, v, distance, INV_FREQ, key_padding_mask=mask), expect,
                                   atol=1e-12, rtol=1e-12)


def test_a_cap_changes_far_scores_only():
    q, k, v = _inputs()
    capped = capped_rope_attention_reference(q, k, v, 4, INV_FREQ)
    plain = _causal(q, k, v)
    torch.testing.assert_close(capped[:, :, :5], plain[:, :, :5])  # queries 0..4 reach no key past 4
    assert (capped[:, :, 5:] - plain[:, :, 5:]).abs().amax() > 1e-3


@pytest.mark.parametrize("t", [3, 12, 36])
def test_one_query_equals_keys_moved_to_the_cap(t):
    """For one query at t, capping is the same as moving every key farther than the cap to t - cap
    (how StreamingLLM re-positions its cached sinks) and attending plainly."""
    distance = 4
    q, k, v = _inputs(Tq=1, Tk=t + 1)
    j = torch.arange(t + 1)
    moved = rope_rotate(k, (t - distance - j).clamp(min=0).view(1, 1, -1), INV_FREQ)
    expect = _causal(q, moved, v)
    torch.testing.assert_close(capped_rope_attention_reference(q, k, v, distance, INV_FREQ), expect,
                               atol=1e-12, rtol=1e-12)
    for split in (False, True):
        torch.testing.assert_close(capped_rope_attention(q, k, v, distance, INV_FREQ, split=split), expect,
                                   atol=1e-12, rtol=1e-12)


def test_a_common_position_shift_cancels():
    """Scores depend on distances only: rotating every q and k by the same offset (left padding
    moves RoPE positions against stream indices by a per-row constant) changes nothing."""
    q, k, v = _inputs()
    shift = torch.full((1, 1, 37), 11)
    a = capped_rope_attention_reference(q, k, v, 6, INV_FREQ)
    q2, k2 = rope_rotate(q, shift, INV_FREQ), rope_rotate(k, shift, INV_FREQ)
    b = capped_rope_attention_reference(q2, k2, v, 6, INV_FREQ)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_backward_matches_reference(padded, softcap):
    q, k, v = _inputs(Tq=21, Tk=21)
    mask = _padding(2, 21) if padded else None
    go = torch.randn(2, 4, 21, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (capped_rope_attention_reference, capped_rope_attention):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        kw = {} if fn is capped_rope_attention_reference else {"block_size": 5}
        out = fn(*x, 3, INV_FREQ, softcap=softcap, key_padding_mask=mask, **kw)
        (out * go).sum().backward()
        grads.append([t.grad for t in x])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("Tq,q_start", [(240, None), (150, 60)])
def test_values_and_gradients_over_hundreds_of_tokens(softcap, Tq, q_start):
    """240 keys, the cap at 50 (most pairs beyond it), blocks of 64 queries, GQA, a left-padded row,
    score spreads of ~100 nats, and queries inside the key set: values and q, k, v gradients against
    autograd through the dense reference."""
    q, k, v = _inputs(Tq=Tq, Tk=240, seed=6, scale=3.5)
    mask = padding_mask(2, 240, [0, 31])
    kw = dict(q_start=q_start, softcap=softcap, key_padding_mask=mask)
    assert_values_and_grads_match(
        lambda q, k, v: capped_rope_attention(q, k, v, 50, INV_FREQ, block_size=64, **kw),
        lambda q, k, v: capped_rope_attention_reference(q, k, v, 50, INV_FREQ, **kw),
        (q, k, v),
    )


def test_autograd_never_takes_the_split_form():
    """The split form's log-sum-exp carries no gradient: a call that needs one runs the joint form."""
    q, k, v = _inputs(Tq=12, Tk=12, dtype=torch.float32)
    q.requires_grad_(True)
    out = capped_rope_attention(q, k, v, 3, INV_FREQ)
    out.sum().backward()
    ref_q = q.detach().double().requires_grad_(True)
    capped_rope_attention_reference(ref_q, k.double(), v.double(), 3, INV_FREQ).sum().backward()
    torch.testing.assert_close(q.grad.double(), ref_q.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [False, True])
def test_bf16_and_large_logits(split):
    q, k, v = _inputs(scale=12.0)  # logit spreads of several hundred
    ref = capped_rope_attention_reference(q, k, v, 5, INV_FREQ)
    got = capped_rope_attention(q.float(), k.float(), v.float(), 5, INV_FREQ, block_size=8, split=split)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)
    q16, k16, v16 = (t.bfloat16() for t in _inputs())
    ref16 = capped_rope_attention_reference(q16.double(), k16.double(), v16.double(), 5, INV_FREQ)
    got16 = capped_rope_attention(q16, k16, v16, 5, INV_FREQ, block_size=8, split=split)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.double(), ref16, atol=3e-2, rtol=3e-2)


def test_long_stream_chunks_agree():
    """A 3000-key stream in 512-query chunks (as a cached prefill runs it) against the reference
    on the last chunk, and the two blocked forms against each other over the whole stream."""
    q, k, v = _inputs(B=1, Hq=2, Hkv=1, Tq=3000, Tk=3000, dtype=torch.float32, seed=5)
    whole_joint = capped_rope_attention(q, k, v, 700, INV_FREQ, block_size=256, split=False)
    whole_split = capped_rope_attention(q, k, v, 700, INV_FREQ, block_size=256, split=True)
    torch.testing.assert_close(whole_split, whole_joint, atol=1e-5, rtol=1e-5)
    for start in range(0, 3000, 512):
        end = min(3000, start + 512)
        chunk = capped_rope_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], 700, INV_FREQ)
        torch.testing.assert_close(chunk, whole_joint[:, :, start:end], atol=1e-5, rtol=1e-5)
    ref = capped_rope_attention_reference(q[:, :, -40:].double(), k.double(), v.double(), 700, INV_FREQ)
    torch.testing.assert_close(whole_joint[:, :, -40:].double(), ref, atol=1e-5, rtol=1e-5)


def test_bad_arguments():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="distance"):
        capped_rope_attention(q, k, v, 0, INV_FREQ)
    with pytest.raises(ValueError, match="do not lie"):
        capped_rope_attention(q, k[:, :, :10], v[:, :, :10], 3, INV_FREQ)
