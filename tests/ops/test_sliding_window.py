"""Sliding-window attention: the O(T*w) blocked form against a per-query loop and the dense form."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from retrofit.ops import sliding_window_attention, sliding_window_attention_reference
from tests.ops._grads import assert_values_and_grads_match
from tests.ops._inputs import attention_inputs, padding_mask


def _loop_reference(q, k, v, window, scaling, softcap, mask, num_past):
    """Independent per-query evaluation of the definition (t - w < s <= t, padded keys skipped)."""
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
                out[b, h, t] = torch.softmax(scores, 0) @ v[b, h // group, keys].double()
    return out


@settings(max_examples=20, deadline=None)
@given(
    T=st.integers(1, 45),
    window=st.integers(1, 12),
    num_past=st.integers(0, 14),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    softcap=st.sampled_from([None, 5.0]),
    pad=st.integers(0, 10),
)
def test_blocked_matches_loop(T, window, num_past, heads, softcap, pad):
    Hq, Hkv = heads
    q = torch.randn(2, Hq, T, 4, dtype=torch.float64) * 2
    k = torch.randn(2, Hkv, num_past + T, 4, dtype=torch.float64) * 2
    v = torch.randn(2, Hkv, num_past + T, 3, dtype=torch.float64)
    mask = padding_mask(2, num_past + T, [0, pad])
    out = sliding_window_attention(q, k, v, window, scaling=0.5, softcap=softcap, key_padding_mask=mask, num_past=num_past)
    ref = _loop_reference(q, k, v, window, 0.5, softcap, mask, num_past)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("T,window", [(300, 32), (257, 128), (128, 128), (1000, 7)])
def test_blocked_matches_dense_long(T, window):
    q = torch.randn(1, 4, T, 16)
    k = torch.randn(1, 2, T, 16)
    v = torch.randn(1, 2, T, 16)
    mask = padding_mask(1, T, [5])
    out = sliding_window_attention(q, k, v, window, key_padding_mask=mask)
    ref = sliding_window_attention_reference(q.double(), k.double(), v.double(), window, key_padding_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_window_at_least_T_is_full_causal_attention():
    q, k, v = (torch.randn(2, 2, 50, 8) for _ in range(3))
    out = sliding_window_attention(q, k, v, 64)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)


def test_large_logits_and_bf16():
    q = torch.randn(1, 2, 300, 16) * 30
    k = torch.randn(1, 2, 300, 16) * 30
    v = torch.randn(1, 2, 300, 16)
    ref = sliding_window_attention_reference(q.double(), k.double(), v.double(), 64, softcap=50.0)
    out = sliding_window_attention(q, k, v, 64, softcap=50.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    out_bf16 = sliding_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 64)
    ref_bf16 = sliding_window_attention_reference(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), 64)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.double(), ref_bf16, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_gradcheck(softcap):
    q = torch.randn(1, 2, 13, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 13, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 13, 3, dtype=torch.float64, requires_grad=True)
    mask = padding_mask(1, 13, [2])
    assert gradcheck(lambda a, b, c: sliding_window_attention(a, b, c, 4, softcap=softcap, key_padding_mask=mask), (q, k, v))


def test_gradients_blocked_vs_dense_fp32():
    q, k, v = (torch.randn(2, 4, 200, 16) for _ in range(3))
    g = torch.randn(2, 4, 200, 16)
    grads = []
    for fn in (sliding_window_attention, sliding_window_attention_reference):
        args = [x.clone().requires_grad_() for x in (q, k, v)]
        (fn(*args, 48) * g).sum().backward()
        grads.append([x.grad for x in args])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_key_count_must_match():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="num_past"):
        sliding_window_attention(q, torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2), 3)


# ---- the two blocked implementations, called directly -------------------------------------
# sliding_window_attention runs _banded_blocked on CPU and _masked_blocked elsewhere; both are
# checked here on CPU against the per-query loop.

from retrofit.ops import sliding_window as swa_module  # noqa: E402

BLOCKED = {
    "banded": swa_module._banded_blocked,  # its default query block (_query_block)
    "banded_half": lambda *a: swa_module._banded_blocked(*a, block=a[3] // 2 if a[3] % 2 == 0 else a[3]),
    "banded_one": lambda *a: swa_module._banded_blocked(*a, block=1),  # w + 1 key spans per query
    "masked": swa_module._masked_blocked,
}


@pytest.mark.parametrize("impl", sorted(BLOCKED))
@settings(max_examples=20, deadline=None)
@given(
    T=st.integers(2, 60),
    window=st.integers(1, 14),
    num_past=st.integers(0, 14),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    softcap=st.sampled_from([None, 4.0]),
    pads=st.sampled_from([None, [0, 3], [7, 0]]),
    scale=st.sampled_from([0.5, 8.0]),
)
def test_blocked_impls_match_loop(impl, T, window, num_past, heads, softcap, pads, scale):
    Hq, Hkv = heads
    num_past = min(num_past, window)  # the public function trims longer caches first
    q = torch.randn(2, Hq, T, 4, dtype=torch.float64) * scale
    k = torch.randn(2, Hkv, num_past + T, 4, dtype=torch.float64) * scale
    v = torch.randn(2, Hkv, num_past + T, 3, dtype=torch.float64)
    mask = None if pads is None else padding_mask(2, num_past + T, pads)
    out = BLOCKED[impl](q, k, v, window, 0.5, softcap, mask, num_past)
    ref = _loop_reference(q, k, v, window, 0.5, softcap, mask, num_past)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def _on_cuda(q, k, v, window, scaling, softcap, mask, num_past):
    """The public op on a CUDA device, where the torch backend takes the masked SDPA form."""
    to = lambda x: None if x is None else x.cuda()  # noqa: E731
    out = sliding_window_attention(to(q), to(k), to(v), window, scaling=scaling, softcap=softcap, key_padding_mask=to(mask),
                                   num_past=num_past, backend="torch")
    return out.cpu()


@pytest.mark.parametrize("impl", ["banded", "masked", "cuda"])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("num_past", [0, 20])
def test_blocked_values_and_gradients_match_the_dense_reference(impl, softcap, num_past):
    """Both blocked forms, called directly on CPU (the masked SDPA form is what CUDA without flash-attn
    and MPS run), and the public op on CUDA where there is one: values and the q, k, v gradients over
    300 queries (cached keys in front, GQA, left padding, score spreads of ~100 nats) against autograd
    through the dense masked softmax."""
    if impl == "cuda" and not torch.cuda.is_available():
        pytest.skip("the public op takes the masked form only on a CUDA device; covered on CPU by 'masked'")
    T, window = 300, 32
    q, k, v = attention_inputs(2, 4, 2, T, num_past + T, 8, seed=4, scale=3.5)
    mask = padding_mask(2, num_past + T, [0, 45])
    blocked = _on_cuda if impl == "cuda" else BLOCKED[impl]
    assert_values_and_grads_match(
        lambda q, k, v: blocked(q, k, v, window, 0.6, softcap, mask, num_past),
        lambda q, k, v: sliding_window_attention_reference(q, k, v, window, scaling=0.6, softcap=softcap,
                                                           key_padding_mask=mask, num_past=num_past),
        (q, k, v),
    )


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("T,window,block,heads,pads", [
    (13, 4, 4, (2, 1), None), (12, 4, 4, (2, 2), [3]), (9, 1, 1, (2, 2), None), (11, 3, 3, (4, 2), [2]),
    (13, 4, 2, (2, 1), [2]), (14, 6, 3, (4, 2), None), (11, 4, 1, (2, 2), [3]),
])
def test_banded_gradcheck(T, window, block, heads, pads, softcap):
    q = torch.randn(1, heads[0], T, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, heads[1], T, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, heads[1], T, 3, dtype=torch.float64, requires_grad=True)
    mask = None if pads is None else padding_mask(1, T, pads)
    fn = lambda a, b, c: swa_module._banded_blocked(a, b, c, window, 0.7, softcap, mask, 0, block=block)  # noqa: E731
    assert gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("block,num_past", [(4, 3), (2, 3), (2, 4), (1, 1), (4, 0)])
def test_banded_gradcheck_with_cached_keys(block, num_past):
    q = torch.randn(1, 2, 10, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 10 + num_past, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 10 + num_past, 3, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b, c: swa_module._banded_blocked(a, b, c, 4, 0.7, None, None, num_past, block=block)  # noqa: E731
    assert gradcheck(fn, (q, k, v))


def test_banded_block_must_divide_the_window():
    q = torch.randn(1, 1, 10, 3)
    with pytest.raises(ValueError, match="divide"):
        swa_module._banded_blocked(q, q, q, 4, 0.7, None, None, 0, block=3)


def test_default_query_block_divides_the_window():
    assert swa_module._query_block(128) == 32 and swa_module._query_block(512) == 64
    assert swa_module._query_block(2048) == 64 and swa_module._query_block(1000) == 50
    assert swa_module._query_block(7) == 7 and swa_module._query_block(16) == 16 and swa_module._query_block(34) == 17
    for w in range(1, 600):
        assert w % swa_module._query_block(w) == 0


def test_blocked_takes_strided_inputs():
    """Attention layers hand over (B, T, H, d) projections transposed to (B, H, T, d)."""
    q, k, v = (torch.randn(1, 256, 2, 8).transpose(1, 2) for _ in range(3))
    out = sliding_window_attention(q, k, v, 64)
    ref = sliding_window_attention_reference(q.double(), k.double(), v.double(), 64)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_long_large_logits_fwd_bwd(dtype, tol):
    """T = 1000 (not a multiple of w = 128), logit spread ~ +-60, GQA, left padding; forward and gradients."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1000, 32) * 4
    k = torch.randn(2, 2, 1000, 32) * 4
    v = torch.randn(2, 2, 1000, 32)
    g = torch.randn(2, 4, 1000, 32)
    mask = padding_mask(2, 1000, [0, 300])
    results = []
    for fn, cast in ((sliding_window_attention, dtype), (sliding_window_attention_reference, torch.float64)):
        # the reference sees the same (rounded) inputs, so only the kernel's own error is measured
        args = [x.to(dtype).to(cast).detach().requires_grad_() for x in (q, k, v)]
        out = fn(*args, 128, key_padding_mask=mask)
        (out * g.to(dtype).to(cast)).sum().backward()
        results.append([out.detach(), *(x.grad for x in args)])
    for got, want in zip(*results):
        assert got.dtype == dtype and torch.isfinite(got).all()
        scale = want.abs().max()
        torch.testing.assert_close(got.double() / scale, want / scale, atol=tol, rtol=0)


# ---- output and log-sum-exp from one banded pass (the sink merge's window part on CPU) -----------


@pytest.mark.parametrize("T,window,num_past,heads,softcap,pads", [
    (40, 8, 0, (4, 2), None, None), (37, 8, 5, (2, 1), 3.0, [4]), (64, 16, 16, (2, 2), None, [0, 9]),
    (30, 4, 9, (4, 1), 2.0, None), (6, 8, 3, (2, 1), None, None),  # the last: fewer queries than w
])
def test_attention_with_lse_matches_the_two_functions(T, window, num_past, heads, softcap, pads):
    """Values and the gradients of a loss that uses both outputs, against sliding_window_attention
    and sliding_window_lse run apart (the lse's gradient flows into q and k)."""
    from retrofit.ops.sliding_window import sliding_window_attention_with_lse, sliding_window_lse

    B = 1 if pads is None else len(pads)
    leaves = [torch.randn(B, h, n, 8, dtype=torch.float64) * 2
              for h, n in ((heads[0], T), (heads[1], T + num_past), (heads[1], T + num_past))]
    mask = None if pads is None else padding_mask(B, T + num_past, pads)
    kw = dict(scaling=0.5, softcap=softcap, key_padding_mask=mask, num_past=num_past)
    weights = torch.randn(B, heads[0], T, dtype=torch.float64)

    def loss(pair):
        out, lse = pair
        return out.square().sum() + (lse * weights).sum(), out, lse

    fused_in = [x.clone().requires_grad_() for x in leaves]
    l1, out1, lse1 = loss(sliding_window_attention_with_lse(*fused_in, window, **kw))
    l1.backward()
    apart_in = [x.clone().requires_grad_() for x in leaves]
    q, k, v = apart_in
    l2, out2, lse2 = loss((sliding_window_attention(q, k, v, window, **kw), sliding_window_lse(q, k, window, **kw)))
    l2.backward()
    valid = torch.ones_like(lse1, dtype=torch.bool) if mask is None else mask[:, None, num_past:].expand_as(lse1)
    torch.testing.assert_close(out1, out2, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse1[valid], lse2[valid], atol=1e-12, rtol=1e-12)  # padded queries: unused
    for a, b in zip(fused_in, apart_in):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_banded_gradcheck_with_lse(softcap):
    q = torch.randn(1, 2, 13, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 13, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 13, 3, dtype=torch.float64, requires_grad=True)
    mask = padding_mask(1, 13, [2])
    fn = lambda a, b, c: swa_module._banded_blocked(a, b, c, 4, 0.7, softcap, mask, 0, block=2, with_lse=True)  # noqa: E731
    assert gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("T,window,num_past,pads", [(61, 8, 0, None), (61, 8, 5, [0, 7]), (40, 16, 16, [3, 0]),
                                                    (9, 8, 3, None)])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_no_grad_segments_equal_one_pass(monkeypatch, T, window, num_past, pads, softcap):
    """Without autograd the banded form scores a few query blocks at a time (here one or two per
    segment): output and window log-sum-exp equal the one-pass form, past keys and padding included."""
    B = 1 if pads is None else len(pads)
    q = torch.randn(B, 4, T, 8, dtype=torch.float64) * 3
    k, v = (torch.randn(B, 2, T + num_past, 8, dtype=torch.float64) * 3 for _ in range(2))
    mask = None if pads is None else padding_mask(B, T + num_past, pads)
    args = (q, k, v, window, 0.5, softcap, mask, num_past)
    with torch.no_grad():
        whole_out, whole_lse = swa_module._banded_blocked(*args, block=4, with_lse=True)
        for blocks in (1, 2):
            monkeypatch.setattr(swa_module, "NO_GRAD_SCORE_BYTES", blocks * B * 4 * 4 * (window + 4) * 8)
            out, lse = swa_module._banded_blocked(*args, block=4, with_lse=True)
            torch.testing.assert_close(out, whole_out, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(lse, whole_lse, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(swa_module._banded_blocked(*args, block=4), whole_out, atol=1e-12, rtol=1e-12)
    want = sliding_window_attention_reference(q, k, v, window, scaling=0.5, softcap=softcap, key_padding_mask=mask,
                                              num_past=num_past)
    valid = torch.ones(B, 1, T, 1, dtype=torch.bool) if mask is None else mask[:, None, num_past:, None]
    torch.testing.assert_close(out * valid, want * valid, atol=1e-10, rtol=1e-10)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pads", [None, [0, 37]])
def test_cuda_masked_form_runs_on_a_fused_sdpa_kernel(dtype, pads):
    """With SDPA's math kernel switched off the masked form still runs (4-D inputs), and agrees."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    T, w = 300, 64
    q = torch.randn(2, 9, T, 64, dtype=dtype)
    k, v = torch.randn(2, 3, T, 64, dtype=dtype), torch.randn(2, 3, T, 64, dtype=dtype)
    mask = None if pads is None else padding_mask(2, T, pads)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = _on_cuda(q, k, v, w, 0.125, None, mask, 0)
    ref = _loop_reference(q.double(), k.double(), v.double(), w, 0.125, None, mask, 0)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (5e-3 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("Tq, window, num_past, heads, pads, scale, calls_per_op", [
    # at most 2w keys: one kernel call over all of them
    (24, 24, 0, (4, 4), None, 1.0, 1),       # the whole call inside one window: causal attention
    (20, 24, 9, (6, 2), [12, 0], 1.0, 1),    # cached keys, some out of the first queries' windows; 3 padded queries
    (16, 16, 16, (4, 1), [0, 19], 8.0, 1),   # large logits (q and k x 8), one KV head, 3 padded queries
    (40, 24, 6, (4, 2), [0, 9], 1.0, 1),     # more queries than the window, 46 keys <= 2w
    # more keys: one call per block of w queries
    (61, 8, 0, (4, 2), None, 1.0, 8),        # a tail block: 61 queries, blocks of 8
    (40, 16, 16, (6, 2), [0, 21], 1.0, 3),   # cached keys; 5 padded queries in the second row
    (50, 8, 5, (4, 1), [3, 0], 8.0, 7),      # large logits, one KV head, padded cached keys
])
def test_fused_forms_match_the_definition(monkeypatch, dtype, tol, Tq, window, num_past, heads, pads, scale,
                                          calls_per_op):
    """Without autograd on a CPU (heads of at most FUSED_MAX_HEAD_DIM), the window runs PyTorch's fused
    attention kernel, masked to each query's window: over all keys up to 2w, else block by block. Its
    output and window log-sum-exp equal the per-query definition and the float64 dense form (cached
    keys, padding, grouped heads, large logits, bf16), and the kernel ran as many times as planned."""
    from retrofit.ops.sliding_window import sliding_window_attention_with_lse, sliding_window_lse

    if swa_module._FUSED_CPU is None:
        pytest.skip("this PyTorch has no fused CPU attention op")
    calls = []
    kernel = swa_module._FUSED_CPU
    monkeypatch.setattr(swa_module, "_FUSED_CPU", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    B = 1 if pads is None else len(pads)
    q, k, v = attention_inputs(B, heads[0], heads[1], Tq, Tq + num_past, 16, dtype=dtype, scale=scale)
    mask = None if pads is None else padding_mask(B, Tq + num_past, pads)
    kw = dict(scaling=0.25, key_padding_mask=mask, num_past=num_past)
    with torch.no_grad():
        out = sliding_window_attention(q, k, v, window, **kw)
        out2, lse = sliding_window_attention_with_lse(q, k, v, window, **kw)
    assert len(calls) == 2 * calls_per_op and out.dtype == dtype and lse.dtype == torch.float32
    ref = _loop_reference(q, k, v, window, 0.25, None, mask, num_past)  # float64 of the same (rounded) inputs
    ref_lse = sliding_window_lse(q.double(), k.double(), window, **kw)
    valid = torch.ones_like(lse, dtype=torch.bool) if mask is None else mask[:, None, num_past:].expand_as(lse)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)
    torch.testing.assert_close(lse[valid].double(), ref_lse[valid], atol=tol * scale, rtol=tol)
    assert not out[~valid].any()  # padded queries return zeros


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("Tq, window, num_past, heads, scale", [
    (24, 8, 0, (4, 2), 1.0),     # a first call: block 0 causal alone, then full blocks
    (19, 8, 7, (4, 2), 1.0),     # the next call: w - 1 cached keys, a 3-query tail block
    (13, 8, 8, (6, 2), 8.0),     # w cached keys (the oldest seen by none), large logits
    (20, 8, 3, (4, 1), 1.0),     # few cached keys: block 0's previous slots mostly before the stream
    (5, 8, 2, (2, 2), 1.0),      # one block shorter than the window and its cached keys
    (9, 1, 0, (2, 1), 8.0),      # w = 1: every query sees only itself
    (33, 16, 15, (3, 3), 8.0),   # large logits, no grouping, a 1-query tail block
])
def test_band_form_matches_the_definition(monkeypatch, dtype, tol, Tq, window, num_past, heads, scale):
    """Unpadded calls of BAND_MIN_QUERIES queries or more run the window as unmasked kernel calls over
    key sets (the block's own keys causal, the previous block's keys seen by every row, and the rest
    reversed and causal), merged by log-sum-exp: output and window log-sum-exp equal the per-query
    definition (every cached-key count up to w, tail blocks, grouped heads, large logits, bf16), with
    or without an all-True key padding mask."""
    from retrofit.ops.sliding_window import sliding_window_attention_with_lse, sliding_window_lse

    if swa_module._FUSED_CPU is None:
        pytest.skip("this PyTorch has no fused CPU attention op")
    calls = []
    kernel = swa_module._FUSED_CPU
    monkeypatch.setattr(swa_module, "_FUSED_CPU", lambda *a, **kw: calls.append(kw.get("attn_mask")) or kernel(*a, **kw))
    monkeypatch.setattr(swa_module, "BAND_MIN_QUERIES", 1)
    q, k, v = attention_inputs(1, heads[0], heads[1], Tq, Tq + num_past, 16, dtype=dtype, scale=scale)
    with torch.no_grad():
        out, lse = sliding_window_attention_with_lse(q, k, v, window, scaling=0.25, num_past=num_past)
        # a mask with no padding in it (what a cache passes) takes the same unmasked calls
        everyone = torch.ones(1, Tq + num_past, dtype=torch.bool)
        same = sliding_window_attention_with_lse(q, k, v, window, scaling=0.25, num_past=num_past,
                                                 key_padding_mask=everyone)
    assert calls and all(m is None for m in calls) and out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(same[0], out) and torch.equal(same[1], lse)
    ref = _loop_reference(q, k, v, window, 0.25, None, None, num_past)
    ref_lse = sliding_window_lse(q.double(), k.double(), window, scaling=0.25, num_past=num_past)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol * scale, rtol=tol)


def test_wide_heads_run_the_banded_form_past_the_window(monkeypatch):
    """Heads wider than FUSED_MAX_HEAD_DIM keep the banded form for calls of more than w queries (its
    GEMMs win there) and take the fused kernel for calls of at most w."""
    calls = []
    kernel = swa_module._FUSED_CPU
    monkeypatch.setattr(swa_module, "_FUSED_CPU", lambda *a, **kw: calls.append(a[0].shape[2]) or kernel(*a, **kw))
    monkeypatch.setattr(swa_module, "FUSED_MAX_HEAD_DIM", 4)
    q, k, v = attention_inputs(1, 4, 2, 40, 46, 8, dtype=torch.float32)
    from retrofit.ops.sliding_window import sliding_window_attention_with_lse

    with torch.no_grad():
        out, _ = sliding_window_attention_with_lse(q, k, v, 16, num_past=6)  # 40 queries > w
        short, _ = sliding_window_attention_with_lse(q[:, :, :12], k[:, :, :18], v[:, :, :18], 16, num_past=6)
        ref = sliding_window_attention_reference(q.double(), k.double(), v.double(), 16, num_past=6)
    assert calls == [12]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(short.double(), ref[:, :, :12], atol=1e-5, rtol=1e-5)


def test_fused_dense_region_is_not_used_under_autograd(monkeypatch):
    """Its log-sum-exp has no gradient: with inputs that need one, the dense form runs (and trains)."""
    calls = []
    monkeypatch.setattr(swa_module, "_FUSED_CPU", lambda *a, **kw: calls.append(1))
    q, k, v = (x.requires_grad_() for x in attention_inputs(1, 4, 2, 12, 12, 8, dtype=torch.float32))
    from retrofit.ops.sliding_window import sliding_window_attention_with_lse

    out, lse = sliding_window_attention_with_lse(q, k, v, 16)
    (out.sum() + lse.sum()).backward()
    assert calls == [] and q.grad is not None and k.grad.abs().sum() > 0
