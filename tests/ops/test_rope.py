"""RoPE re-rotation: the family layout, composition, and what a score then depends on."""
from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

from retrofit.ops.rope import rope_rotate

INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).double() / 16))


def _hf_rotate(x, pos):
    """transformers' own rotation (cos / sin laid out as the rotary embedding makes them)."""
    emb = torch.cat([pos.double()[:, None] * INV_FREQ] * 2, dim=-1)
    return apply_rotary_pos_emb(x, x, emb.cos(), emb.sin(), unsqueeze_dim=0)[0]


def test_matches_transformers_rotation():
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    pos = torch.tensor([0, 1, 5, 100, 4095, 32768, 131071])
    torch.testing.assert_close(rope_rotate(x, pos, INV_FREQ), _hf_rotate(x, pos), atol=1e-9, rtol=1e-9)


def test_rotations_compose_and_invert():
    x = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    a, b = torch.tensor([3, 70000, 0, 9, 1]), torch.tensor([-3, 5, 123456, -9, 2])
    torch.testing.assert_close(rope_rotate(rope_rotate(x, a, INV_FREQ), b, INV_FREQ), rope_rotate(x, a + b, INV_FREQ))
    torch.testing.assert_close(rope_rotate(rope_rotate(x, a, INV_FREQ), -a, INV_FREQ), x)


def test_score_depends_on_the_distance_only():
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    score = lambda t, s: (rope_rotate(q[None], torch.tensor([t]), INV_FREQ) * rope_rotate(k[None], torch.tensor([s]), INV_FREQ)).sum()  # noqa: E731
    torch.testing.assert_close(score(50000, 49000), score(1000, 0))
    assert not torch.isclose(score(50000, 49000), score(50000, 0))


def test_partial_rotary_leaves_the_tail_alone():
    x = torch.randn(1, 1, 3, 20, dtype=torch.float64)
    out = rope_rotate(x, torch.tensor([1, 2, 3]), INV_FREQ)  # 8 frequencies: dims 0..15 rotate
    torch.testing.assert_close(out[..., 16:], x[..., 16:], atol=0, rtol=0)
    assert not torch.allclose(out[..., :16], x[..., :16])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
def test_to_origin_equals_rotating_back_by_each_position(dtype, tol):
    """The cached-table form gives what rope_rotate by -position gives, also after the table grows
    (a short call first, then one past its size) and for a partial-rotary head."""
    from retrofit.ops.rope import rope_to_origin

    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 6, 2, dtype=torch.float32) / 6))  # F = 3 of d = 8
    for n in (7, 2500):
        x = torch.randn(2, 3, n, 8, generator=torch.Generator().manual_seed(n)).to(dtype)
        want = rope_rotate(x.double(), -torch.arange(n), inv_freq)
        got = rope_to_origin(x, inv_freq)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("scale", [1.0, 1.37])
def test_move_equals_unrotating_then_rotating_to_the_position(dtype, tol, scale):
    """rope_move in one rotation = rope_unrotate then rope_rotate to the fixed position: positions
    differing per row (left padding), far positions (the angles' range), an attention scaling folded
    into cos / sin (YaRN's), and a partial-rotary tail left alone."""
    from retrofit.ops.rope import rope_at, rope_move, rope_unrotate

    # F = 8 frequencies of d = 20: dims 16..19 do not rotate
    pos = torch.tensor([[0, 1, 2, 3, 4], [70000, 70001, 70002, 70003, 131071]])
    emb = torch.cat([pos.double()[..., None] * INV_FREQ] * 2, dim=-1)
    cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    x = torch.randn(2, 3, 5, 20, dtype=torch.float64)
    y = torch.cat([apply_rotary_pos_emb(x[..., :16], x[..., :16], emb.cos() * scale, emb.sin() * scale)[0],
                   x[..., 16:]], -1).to(dtype)  # the model's post-RoPE vectors at pos
    for target in (0, 1023, 8191):
        got = rope_move(y, cos, sin, rope_at(target, INV_FREQ))
        assert got.dtype == dtype
        want = rope_rotate(x, torch.tensor(float(target)), INV_FREQ)  # the raw vector put at the target
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        two = rope_rotate(rope_unrotate(y.double(), cos.double(), sin.double()), torch.tensor(float(target)), INV_FREQ)
        torch.testing.assert_close(got.double(), two, atol=tol, rtol=tol)
        torch.testing.assert_close(got[..., 16:], y[..., 16:], atol=0, rtol=0)
