"""LAVO: orthogonal memory (parallel / recurrent / dense), local attention with a relative
position bias (blocked / dense / loop), and their gated average, incl. cached decoding."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from retrofit.ops.lavo import (
    LavoState,
    lavo_attention,
    lavo_attention_reference,
    local_attention,
    local_attention_reference,
    orthogonal_memory_attention,
    orthogonal_memory_attention_reference,
    orthogonal_memory_recurrent,
)
from retrofit.ops.sliding_window import sliding_window_attention
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import padding_mask


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _bases(H, r, d, dtype=torch.float64):
    """Orthonormal rows, as the layer initialises them."""
    return torch.linalg.qr(torch.randn(H, d, r, dtype=dtype))[0].transpose(1, 2).contiguous()


def _memory_loop(q, x, bases, block, scaling, mask):
    """Eq. 4 / context dissection literally: a python loop over queries and their visible tokens."""
    B, H, T, d = x.shape
    out = torch.zeros(B, H, T, d, dtype=torch.float64)
    for b in range(B):
        real = [s for s in range(T) if mask is None or mask[b, s]]
        for i, t in enumerate(real):
            n_vis = i + 1 if block is None else block * (i // block)
            if n_vis == 0:
                continue
            for h in range(H):
                Bh = bases[h].double()
                Hm = torch.stack([Bh @ x[b, h, s].double() for s in real[:n_vis]]).mean(0)  # (r,)
                mem = Bh * Hm[:, None]  # B (.) H: row i = H_i b_i
                out[b, h, t] = torch.softmax(scaling * mem @ q[b, h, t].double(), 0) @ mem
    return out


def _local_loop(q, k, v, window, bias, scaling, softcap, mask, num_past=0):
    B, Hq, Tq, _ = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(B, Hq, Tq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for t in range(Tq):
                tp = t + num_past
                if mask is not None and not mask[b, tp]:
                    continue
                keys = [s for s in range(max(0, tp - window + 1), tp + 1) if mask is None or mask[b, s]]
                scores = (k[b, h // group, keys].double() @ q[b, h, t].double()) * scaling
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                scores = scores + torch.stack([bias[h, tp - s].double() for s in keys])
                out[b, h, t] = torch.softmax(scores, 0) @ v[b, h // group, keys].double()
    return out


# ------------------------------------------------------------------ orthogonal memory


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 30), block=st.sampled_from([None, 1, 3, 8]), pad=st.integers(0, 7), hole=st.booleans())
def test_memory_parallel_recurrent_dense_match_loop(T, block, pad, hole):
    q, x = torch.randn(2, 2, T, 5, dtype=torch.float64) * 2, torch.randn(2, 2, T, 5, dtype=torch.float64)
    bases = _bases(2, 3, 5)
    mask = padding_mask(2, T, [0, pad])
    if hole and T > 3:
        mask[0, T // 2] = False
    ref = _memory_loop(q, x, bases, block, 0.7, mask)
    par, _ = orthogonal_memory_attention(q, x, bases, block=block, scaling=0.7, key_padding_mask=mask)
    rec, _ = orthogonal_memory_recurrent(q, x, bases, block=block, scaling=0.7, key_padding_mask=mask)
    dense = orthogonal_memory_attention_reference(q, x, bases, block=block, scaling=0.7, key_padding_mask=mask)
    for got in (par, rec, dense):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("block", [None, 5])
def test_memory_chunks_continue_from_state(block):
    T = 47
    q, x = torch.randn(2, 3, T, 6, dtype=torch.float64), torch.randn(2, 3, T, 6, dtype=torch.float64)
    bases = _bases(3, 4, 6)
    mask = padding_mask(2, T, [0, 6])
    full, full_state = orthogonal_memory_attention(q, x, bases, block=block, key_padding_mask=mask, output_final_state=True)
    _, rec_state = orthogonal_memory_recurrent(q, x, bases, block=block, key_padding_mask=mask)
    state, outs = None, []
    for a, b in [(0, 1), (1, 4), (4, 20), (20, 21), (21, 47)]:
        o, state = orthogonal_memory_attention(
            q[:, :, a:b], x[:, :, a:b], bases, block=block, key_padding_mask=mask[:, a:b],
            initial_state=state, output_final_state=True,
        )
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-12, rtol=1e-12)
    for s in (state, rec_state):
        torch.testing.assert_close(s.committed, full_state.committed)
        torch.testing.assert_close(s.pending, full_state.pending)
        assert s.count.tolist() == full_state.count.tolist()
        assert s.pending_count.tolist() == full_state.pending_count.tolist()
    expect = [47, 41] if block is None else [45, 40]
    assert full_state.count.tolist() == expect


def test_memory_rows_are_orthogonal_and_first_window_reads_nothing():
    x = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    bases = _bases(1, 4, 8)
    torch.testing.assert_close(bases[0] @ bases[0].T, torch.eye(4, dtype=torch.float64))
    out, _ = orthogonal_memory_attention(torch.randn_like(x), x, bases, block=4)
    assert out[:, :, :4].abs().max() == 0  # no complete window before the first
    assert out[:, :, 4:].abs().min() > 0


def _memory_at(q, x, bases, block, scaling, positions):
    """Eqs. 3-4 at a few query positions of an unpadded sequence, in fp64: the mean of the visible
    memory inputs taken directly (no running sums), projected, scaled and read."""
    out = []
    for t in positions:
        n_vis = t + 1 if block is None else block * (t // block)
        if n_vis == 0:
            out.append(torch.zeros_like(q[:, :, t], dtype=torch.float64))
            continue
        h = torch.einsum("bhd,hrd->bhr", x[:, :, :n_vis].double().mean(2), bases.double())  # (B, H, r)
        memory = h[..., None] * bases.double()  # (B, H, r, d): row i = H_i b_i
        p = torch.softmax(scaling * torch.einsum("bhd,bhrd->bhr", q[:, :, t].double(), memory), -1)
        out.append(torch.einsum("bhr,bhrd->bhd", p, memory))
    return torch.stack(out, 2)


def test_memory_long_sequence_fp32_stays_accurate():
    T = 6000
    q, x = torch.randn(1, 2, T, 16) * 3, torch.randn(1, 2, T, 16) + 0.5
    bases = _bases(2, 8, 16, dtype=torch.float32)
    out, _ = orthogonal_memory_attention(q, x, bases, block=64, scaling=4.0)
    assert torch.isfinite(out).all()
    positions = [0, 63, 64, 65, 127, 128, 1000, 2047, 2048, 4095, 4500, 5950, 5999]
    ref = _memory_at(q, x, bases, 64, 4.0, positions)
    torch.testing.assert_close(out[:, :, positions].double(), ref, atol=1e-4, rtol=1e-4)


def test_memory_gradcheck():
    q = torch.randn(2, 2, 11, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 2, 11, 3, dtype=torch.float64, requires_grad=True)
    bases = _bases(2, 2, 3).requires_grad_()
    mask = padding_mask(2, 11, [0, 3])
    for block in (None, 3):
        assert gradcheck(lambda a, b, c: orthogonal_memory_attention(a, b, c, block=block, scaling=0.9, key_padding_mask=mask)[0], (q, x, bases))


# ------------------------------------------------------------------ local attention with bias


@settings(max_examples=20, deadline=None)
@given(
    T=st.integers(1, 40),
    window=st.integers(1, 10),
    num_past=st.integers(0, 12),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    softcap=st.sampled_from([None, 5.0]),
    pad=st.integers(0, 9),
)
def test_local_blocked_and_dense_match_loop(T, window, num_past, heads, softcap, pad):
    Hq, Hkv = heads
    q = torch.randn(2, Hq, T, 4, dtype=torch.float64) * 2
    k = torch.randn(2, Hkv, num_past + T, 4, dtype=torch.float64) * 2
    v = torch.randn(2, Hkv, num_past + T, 3, dtype=torch.float64)
    bias = torch.randn(Hq, window, dtype=torch.float64) * 2
    mask = padding_mask(2, num_past + T, [0, pad])
    ref = _local_loop(q, k, v, window, bias, 0.5, softcap, mask, num_past)
    kw = dict(rel_bias=bias, scaling=0.5, softcap=softcap, key_padding_mask=mask, num_past=num_past)
    torch.testing.assert_close(local_attention(q, k, v, window, **kw), ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(local_attention_reference(q, k, v, window, **kw), ref, atol=1e-10, rtol=1e-10)


def test_zero_bias_is_exactly_sliding_window_and_shared_bias_broadcasts():
    q, k, v = torch.randn(2, 4, 90, 8), torch.randn(2, 2, 90, 8), torch.randn(2, 2, 90, 8)
    mask = padding_mask(2, 90, [0, 9])
    swa = sliding_window_attention(q, k, v, 16, key_padding_mask=mask)
    torch.testing.assert_close(local_attention(q, k, v, 16, rel_bias=torch.zeros(4, 16), key_padding_mask=mask), swa, atol=1e-6, rtol=1e-6)
    shared = torch.randn(1, 16)
    torch.testing.assert_close(
        local_attention(q, k, v, 16, rel_bias=shared), local_attention(q, k, v, 16, rel_bias=shared.expand(4, 16)), atol=1e-6, rtol=1e-6
    )
    with pytest.raises(ValueError, match="rel_bias"):
        local_attention(q, k, v, 16, rel_bias=torch.zeros(4, 15))


def test_local_gradcheck_including_bias():
    q = torch.randn(1, 2, 13, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 13, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 13, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    mask = padding_mask(1, 13, [2])
    for softcap in (None, 3.0):
        assert gradcheck(lambda a, b, c, p: local_attention(a, b, c, 4, rel_bias=p, softcap=softcap, key_padding_mask=mask), (q, k, v, bias))


@pytest.mark.parametrize("softcap", [None, 6.0])
@pytest.mark.parametrize("num_past", [0, 9, 30])
def test_local_values_and_gradients_match_the_dense_reference(softcap, num_past):
    """The blocked local attention over 250 queries after cached keys (more than the window: some are
    dropped), GQA, a padded row, a shared bias, score spreads of ~100 nats: values and the gradients
    of q, k, v and the bias against autograd through the dense form."""
    T, w = 250, 12
    q = torch.randn(2, 4, T, 5, dtype=torch.float64) * 4
    k = torch.randn(2, 2, num_past + T, 5, dtype=torch.float64) * 4
    v = torch.randn(2, 2, num_past + T, 3, dtype=torch.float64)
    bias = torch.randn(1, w, dtype=torch.float64) * 3
    mask = padding_mask(2, num_past + T, [0, 40])
    kw = dict(scaling=0.6, softcap=softcap, key_padding_mask=mask, num_past=num_past)
    assert_values_and_grads_match(
        lambda q, k, v, bias: local_attention(q, k, v, w, rel_bias=bias, **kw),
        lambda q, k, v, bias: local_attention_reference(q, k, v, w, rel_bias=bias, **kw),
        (q, k, v, bias),
    )


@pytest.mark.parametrize("block", [None, 16])
def test_memory_values_and_gradients_match_the_dense_reference(block):
    """The parallel memory over 300 tokens (left padding and a hole, large read logits): values and
    the gradients of the queries, the memory inputs and the bases against the visibility-matrix form."""
    q, x = torch.randn(2, 3, 300, 6, dtype=torch.float64) * 5, torch.randn(2, 3, 300, 6, dtype=torch.float64)
    bases = _bases(3, 4, 6) * 1.3
    mask = padding_mask(2, 300, [0, 27])
    mask[0, 140:150] = False
    kw = dict(block=block, scaling=3.0, key_padding_mask=mask)
    assert_values_and_grads_match(
        lambda q, x, bases: orthogonal_memory_attention(q, x, bases, **kw)[0],
        lambda q, x, bases: orthogonal_memory_attention_reference(q, x, bases, **kw),
        (q, x, bases),
    )


@pytest.mark.parametrize("block", [None, 16])
def test_memory_recurrent_values_and_gradients_match_the_dense_reference(block):
    """The decoding step, looped over 120 padded tokens: values and the q, x, bases gradients."""
    q, x = torch.randn(2, 3, 120, 6, dtype=torch.float64) * 5, torch.randn(2, 3, 120, 6, dtype=torch.float64)
    mask = padding_mask(2, 120, [0, 27])
    kw = dict(block=block, scaling=3.0, key_padding_mask=mask)
    assert_values_and_grads_match(
        lambda q, x, bases: orthogonal_memory_recurrent(q, x, bases, **kw)[0],
        lambda q, x, bases: orthogonal_memory_attention_reference(q, x, bases, **kw),
        (q, x, _bases(3, 4, 6)),
    )


# ------------------------------------------------------------------ LAVO


def _lavo_inputs(B=2, Hq=4, Hkv=2, T=70, d=8, r=4, w=8, dtype=torch.float64):
    q = torch.randn(B, Hq, T, d, dtype=dtype)
    k = torch.randn(B, Hkv, T, d, dtype=dtype)
    v = torch.randn(B, Hkv, T, d, dtype=dtype)
    qg = torch.randn(B, Hq, T, d, dtype=dtype)
    bases = _bases(Hq, r, d, dtype)
    bias = torch.randn(Hq, w, dtype=dtype)
    g = torch.rand(Hq, dtype=dtype)
    return q, k, v, qg, bases, bias, g


@pytest.mark.parametrize("dissect", [True, False])
def test_lavo_matches_reference_with_gqa_softcap_padding(dissect):
    q, k, v, qg, bases, bias, g = _lavo_inputs()
    mask = padding_mask(2, 70, [0, 13])
    kw = dict(window=8, rel_bias=bias, global_query=qg, global_weight=g, dissect=dissect, scaling=0.3, memory_scaling=2.0, softcap=20.0, key_padding_mask=mask)
    out, state = lavo_attention(q, k, v, bases, output_final_state=True, **kw)
    ref = lavo_attention_reference(q, k, v, bases, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert state.committed.shape == (2, 4, 4)
    assert state.seen.tolist() == [70, 57]


def test_lavo_first_window_is_local_and_zero_weight_is_the_anchor():
    q, k, v, qg, bases, bias, g = _lavo_inputs(dtype=torch.float32)
    local = local_attention(q, k, v, 8, rel_bias=bias)
    out, _ = lavo_attention(q, k, v, bases, window=8, rel_bias=bias, global_query=qg, global_weight=g)
    torch.testing.assert_close(out[:, :, :8], local[:, :, :8], atol=0, rtol=0)
    assert not torch.allclose(out[:, :, 8:], local[:, :, 8:])
    # global weight 0 and zero bias: exactly the pretrained sliding-window attention
    out0, _ = lavo_attention(q, k, v, bases, window=8, rel_bias=torch.zeros_like(bias), global_weight=0.0)
    torch.testing.assert_close(out0, sliding_window_attention(q, k, v, 8), atol=1e-6, rtol=1e-6)
    # the paper's plain average
    out_half, _ = lavo_attention(q, k, v, bases, window=8, rel_bias=bias, global_query=qg)
    glob, _ = orthogonal_memory_attention(qg, local, bases, block=8)
    torch.testing.assert_close(out_half[:, :, 8:], 0.5 * (local + glob)[:, :, 8:], atol=1e-6, rtol=1e-6)


def test_lavo_gradcheck():
    q, k, v, qg, bases, bias, g = (x.requires_grad_() for x in _lavo_inputs(B=1, Hq=2, Hkv=1, T=14, d=3, r=2, w=4))
    mask = padding_mask(1, 14, [2])

    def fn(q, k, v, qg, bases, bias, g):
        return lavo_attention(q, k, v, bases, window=4, rel_bias=bias, global_query=qg, global_weight=g, key_padding_mask=mask, softcap=4.0)[0]

    assert gradcheck(fn, (q, k, v, qg, bases, bias, g))


@pytest.mark.parametrize("dissect", [True, False])
@pytest.mark.parametrize("prefill", [None, 150, 203])
def test_lavo_values_and_gradients_match_the_dense_reference(dissect, prefill):
    """Every input's gradient over 300 tokens against autograd through the dense references of both
    branches: GQA, soft-capping, large logits, a left-padded row and, with ``prefill``, a second call
    that continues the first's memory state over cached keys (gradients flow through the state)."""
    T, w = 300, 16
    q, k, v, qg, bases, bias, g = _lavo_inputs(B=2, Hq=4, Hkv=2, T=T, d=6, r=3, w=w)
    q, k, qg = q * 4, k * 4, qg * 3  # score spreads of ~100 nats
    mask = padding_mask(2, T, [0, 37])
    kw = dict(window=w, dissect=dissect, scaling=0.5, memory_scaling=2.0, softcap=30.0)

    def op(q, k, v, qg, bases, bias, g):
        run = lambda sl, **extra: lavo_attention(  # noqa: E731
            q[:, :, sl], k, v, bases, rel_bias=bias, global_query=qg[:, :, sl], global_weight=g, **kw, **extra)
        if prefill is None:
            return run(slice(None), key_padding_mask=mask)[0]
        p = prefill
        first, state = lavo_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], bases, rel_bias=bias, global_query=qg[:, :, :p],
                                      global_weight=g, key_padding_mask=mask[:, :p], output_final_state=True, **kw)
        rest, _ = run(slice(p, None), key_padding_mask=mask, num_past=p, initial_state=state)
        return torch.cat([first, rest], dim=2)

    def reference(q, k, v, qg, bases, bias, g):
        return lavo_attention_reference(q, k, v, bases, rel_bias=bias, global_query=qg, global_weight=g, key_padding_mask=mask, **kw)

    assert_values_and_grads_match(op, reference, (q, k, v, qg, bases, bias, g))


@pytest.mark.parametrize("prefill", [0, 1, 21])
def test_lavo_cached_decoding_equals_full_forward(prefill):
    T, w = 45, 8
    q, k, v, qg, bases, bias, g = _lavo_inputs(B=3, T=T, w=w, dtype=torch.float32)
    mask = padding_mask(3, T, [0, 4, 11])
    kw = dict(window=w, rel_bias=bias, global_weight=g, softcap=20.0)
    full, _ = lavo_attention(q, k, v, bases, global_query=qg, key_padding_mask=mask, **kw)
    state, outs = None, []
    if prefill:
        o, state = lavo_attention(
            q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], bases, global_query=qg[:, :, :prefill],
            key_padding_mask=mask[:, :prefill], output_final_state=True, **kw,
        )
        outs.append(o)
    for t in range(prefill, T):
        lo = max(0, t - w + 1)  # the ring buffer: the last w - 1 keys before t
        o, state = lavo_attention(
            q[:, :, t : t + 1], k[:, :, lo : t + 1], v[:, :, lo : t + 1], bases, global_query=qg[:, :, t : t + 1],
            key_padding_mask=mask[:, lo : t + 1], num_past=t - lo, initial_state=state, output_final_state=True, **kw,
        )
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)


def test_lavo_left_padded_row_equals_the_row_alone():
    q, k, v, qg, bases, bias, g = _lavo_inputs(B=1, T=40, dtype=torch.float32)
    pad = 5
    padded = [torch.cat([torch.randn(1, x.shape[1], pad, x.shape[-1]), x], dim=2) for x in (q, k, v, qg)]
    mask = padding_mask(1, 40 + pad, [pad])
    alone, _ = lavo_attention(q, k, v, bases, window=8, rel_bias=bias, global_query=qg, global_weight=g)
    out, _ = lavo_attention(*padded[:3], bases, window=8, rel_bias=bias, global_query=padded[3], global_weight=g, key_padding_mask=mask)
    torch.testing.assert_close(out[:, :, pad:], alone, atol=1e-6, rtol=1e-6)
    assert out[:, :, :pad].abs().max() == 0


def test_lavo_single_token_and_bf16():
    q, k, v, qg, bases, bias, g = _lavo_inputs(T=1, dtype=torch.float32)
    out, state = lavo_attention(q, k, v, bases, window=8, rel_bias=bias, output_final_state=True)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1))  # one key; memory still empty
    assert state.pending_count.tolist() == [1, 1]

    q, k, v, qg, bases, bias, g = _lavo_inputs(T=200, w=32, dtype=torch.float32)
    args = [x.bfloat16() for x in (q, k, v)]
    kw = dict(window=32, rel_bias=bias.bfloat16(), global_query=qg.bfloat16(), global_weight=g)
    out, _ = lavo_attention(*args, bases.bfloat16(), **kw)
    ref = lavo_attention_reference(*[x.double() for x in args], bases.bfloat16().double(), **{**kw, "rel_bias": bias.bfloat16().double(), "global_query": qg.bfloat16().double()})
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_state_helpers():
    s = LavoState.empty(3, 2, 4)
    assert s.seen.tolist() == [0, 0, 0]
    t = s.index_select(torch.tensor([2, 0]))
    assert t.committed.shape == (2, 2, 4)
    with pytest.raises(ValueError, match="block"):
        orthogonal_memory_attention(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2), block=0)
