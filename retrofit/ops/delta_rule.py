"""The gated delta rule (Gated DeltaNet): a key -> value memory corrected at every token.

Per head, the state is a matrix ``S`` ``(d, D)`` (key width by value width). Token t decays it
by ``a_t = exp(g_t)`` (``g_t <= 0``), then writes ``v_t`` at key ``k_t`` with strength
``beta_t`` in [0, 1], replacing what ``k_t`` read before (the delta rule), and reads at ``q_t``:

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
        = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T
    o_t = scale * S_t^T q_t

An additive linear-attention state only accumulates ``k v^T``, so old pairs blur together as it
fills; the delta rule overwrites the value stored at a key, which is why it keeps recalling
associations where additive states saturate (DeltaNet, Yang et al. 2024; Gated DeltaNet, 2025).
With ``||k_t|| = 1`` and ``beta_t`` in [0, 1], ``I - beta_t k_t k_t^T`` is a contraction, so the
state stays bounded (the layer L2-normalises its keys).

Three forms, tested against each other:

* :func:`delta_rule_reference`: the recurrence above, token by token (the definition);
* :func:`delta_rule_chunked`: chunks of C tokens in parallel. Within a chunk the corrections
  ``u_i = beta_i (v_i - a_i S_{i-1}^T k_i)`` solve a unit lower-triangular system (the WY
  form of a product of Householder-like factors), so only the state between chunks is
  sequential; O(T (C d + d D)) work, differentiable with autograd;
* :func:`delta_rule_step`: one token from a state (decoding).

Shapes: q, k ``(B, H, T, d)``, v ``(B, H, T, D)``, beta and g ``(B, H, T)``; the state
:class:`DeltaState` holds ``S`` ``(B, H, d, D)`` in fp32 (at least). Padded tokens
(``key_padding_mask`` False) leave the state unchanged and output 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DeltaState", "delta_rule_chunked", "delta_rule_reference", "delta_rule_step", "masked_inputs"]

DEFAULT_DELTA_CHUNK = 64


@dataclass
class DeltaState:
    """The delta-rule memory after some tokens: ``memory`` ``(B, H, d, D)``, fp32 at least."""

    memory: torch.Tensor


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def masked_inputs(q, k, v, beta, g, key_padding_mask, qkv_dtype: torch.dtype | None = None):
    """Inputs with padded tokens made inert: beta = 0 and g = 0 (no write, no decay) and q, k, v
    zeroed (so nothing non-finite there reaches the state). beta and g (zeros when None) in the
    compute dtype (fp32 at least); q, k, v in ``qkv_dtype`` (default: the compute dtype too; a
    fused kernel takes them in its own)."""
    dt = _compute_dtype(v)
    qkv_dtype = qkv_dtype or dt
    q, k, v, beta = q.to(qkv_dtype), k.to(qkv_dtype), v.to(qkv_dtype), beta.to(dt)
    g = torch.zeros_like(beta) if g is None else g.to(dt)
    if key_padding_mask is not None:
        pad = ~key_padding_mask[:, None, :].to(q.device)
        beta, g = beta.masked_fill(pad, 0.0), g.masked_fill(pad, 0.0)
        q, k, v = (x.masked_fill(pad[..., None], 0.0) for x in (q, k, v))
    return q, k, v, beta, g


def _initial_memory(state: DeltaState | None, q: torch.Tensor, v: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    B, H, _, d = q.shape
    if state is None:
        return torch.zeros(B, H, d, v.shape[-1], dtype=dt, device=q.device)
    return state.memory.to(dt)


def delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: DeltaState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, DeltaState | None]:
    """The gated delta rule token by token (the definition the other forms are tested against).

    Args:
        q, k: ``(B, H, T, d)`` read and write keys (the layer L2-normalises them).
        v: ``(B, H, T, D)`` values.
        beta: ``(B, H, T)`` write strengths in [0, 1].
        g: ``(B, H, T)`` log decays ``<= 0`` (None: no decay).
        scale: multiplies the read.
        key_padding_mask: ``(B, T)`` bool, True for real tokens.
        initial_state: the memory before the first token (None: zeros).
        output_final_state: also return the memory after the last token.

    Returns:
        ``(out (B, H, T, D) in v.dtype, DeltaState or None)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import delta_rule_reference
        >>> k = torch.nn.functional.normalize(torch.randn(1, 1, 1, 4), dim=-1).expand(1, 1, 2, 4)
        >>> v = torch.tensor([[[[1.0, 2.0], [5.0, 6.0]]]])  # the second write at the same key replaces the first
        >>> delta_rule_reference(k, k, v, torch.ones(1, 1, 2))[0][0, 0, 1]
        tensor([5., 6.])
    """
    out_dtype = v.dtype
    q, k, v, beta, g = masked_inputs(q, k, v, beta, g, key_padding_mask)
    S = _initial_memory(initial_state, q, v, q.dtype)
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        read = torch.einsum("bhd,bhdD->bhD", k[:, :, t], S)
        S = S + beta[:, :, t, None, None] * k[:, :, t, :, None] * (v[:, :, t] - read)[:, :, None, :]
        outs.append(scale * torch.einsum("bhd,bhdD->bhD", q[:, :, t], S))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    if key_padding_mask is not None:
        out = out.masked_fill(~key_padding_mask[:, None, :, None].to(out.device), 0.0)
    return out.to(out_dtype), (DeltaState(S) if output_final_state else None)


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: DeltaState | None = None,
    output_final_state: bool = False,
    chunk_size: int = DEFAULT_DELTA_CHUNK,
) -> tuple[torch.Tensor, DeltaState | None]:
    """The gated delta rule in chunks of ``chunk_size`` tokens.

    Within a chunk, with ``c_i = g_1 + ... + g_i`` and ``S_0`` the memory entering it,

        u + A u = diag(beta) V - diag(beta e^c) K S_0,   A_ij = beta_i e^(c_i - c_j) k_i . k_j  (j < i)
        O       = scale (diag(e^c) Q S_0 + (Q K^T * e^(c_i - c_j), j <= i) u)
        S_C     = e^(c_C) S_0 + (K * e^(c_C - c))^T u

    so ``u = U - W S_0`` with ``U``, ``W`` from one triangular solve per chunk (all chunks at once),
    and only ``S_0`` runs chunk to chunk. Decay exponents are formed only where ``j <= i`` (they
    are <= 0 there), so no overflow however strong the decay.

    Args:
        q, k, v, beta, g, scale, key_padding_mask, initial_state, output_final_state: as in
            :func:`delta_rule_reference` (q, k ``(B, H, T, d)``, v ``(B, H, T, D)``, beta, g ``(B, H, T)``).
        chunk_size: C, tokens per chunk (the last chunk is padded with inert tokens).

    Returns:
        ``(out (B, H, T, D) in v.dtype, DeltaState (memory (B, H, d, D), fp32 at least) or None)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import delta_rule_chunked, delta_rule_reference
        >>> q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 50, 8), dim=-1) for _ in range(2))
        >>> v, beta = torch.randn(1, 2, 50, 8), torch.rand(1, 2, 50)
        >>> a, _ = delta_rule_chunked(q, k, v, beta, chunk_size=16)
        >>> b, _ = delta_rule_reference(q, k, v, beta)
        >>> torch.allclose(a, b, atol=1e-5)
        True
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, beta, g = masked_inputs(q, k, v, beta, g, key_padding_mask)
    B, H, T, d = q.shape
    D = v.shape[-1]
    S = _initial_memory(initial_state, q, v, q.dtype)
    C = min(chunk_size, max(T, 1))
    N = -(-T // C)
    pad = N * C - T
    if pad:  # trailing inert tokens: beta = g = 0 leaves the memory as it is
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = (torch.nn.functional.pad(x, (0, pad)) for x in (beta, g))
    q, k, v = (x.view(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.view(B, H, N, C), g.view(B, H, N, C)

    c = g.cumsum(-1)  # (B, H, N, C)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    gap = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = gap.exp()  # e^(c_i - c_j) for j <= i, else 0
    kk = k @ k.transpose(-1, -2)
    A = (beta[..., None] * kk * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * c.exp())[..., None] * k], dim=-1)
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :D], UW[..., D:]
    qk = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C), zero above the diagonal
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    chunk_end = c[..., -1].exp()  # (B, H, N)

    # per-chunk views through unbind: its backward stacks the chunks' gradients once, where indexing
    # chunk n would give each of the N chunks a zero-filled gradient of the whole tensor (O(N^2))
    outs = []
    chunks = zip(U.unbind(2), W.unbind(2), q_decayed.unbind(2), qk.unbind(2), k_to_end.unbind(2),
                 chunk_end[..., None, None].unbind(2))
    for U_n, W_n, q_n, qk_n, k_n, end_n in chunks:
        u = U_n - W_n @ S
        outs.append(q_n @ S + qk_n @ u)
        S = end_n * S + k_n.transpose(-1, -2) @ u
    out = (scale * torch.stack(outs, dim=2)).reshape(B, H, N * C, D)[:, :, :T]
    if key_padding_mask is not None:
        out = out.masked_fill(~key_padding_mask[:, None, :, None].to(out.device), 0.0)
    return out.to(out_dtype), (DeltaState(S) if output_final_state else None)


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    state: DeltaState | None = None,
    *,
    scale: float = 1.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, DeltaState]:
    """One token of the gated delta rule (decoding); a padded token keeps the state and outputs 0.

    Args:
        q, k: ``(B, H, 1, d)``; v: ``(B, H, 1, D)``; beta, g: ``(B, H, 1)`` (g None: no decay).
        state: the memory before this token (None: zeros).
        scale: multiplies the read.
        valid: ``(B, 1)`` bool, True for a real token (None: real).

    Returns:
        ``(out (B, H, 1, D) in v.dtype, the new DeltaState)``.

    Example:
        >>> import torch
        >>> from retrofit.ops import delta_rule_chunked, delta_rule_step
        >>> q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 9, 4), dim=-1) for _ in range(2))
        >>> v, beta = torch.randn(1, 2, 9, 3), torch.rand(1, 2, 9)
        >>> _, state = delta_rule_chunked(q[:, :, :8], k[:, :, :8], v[:, :, :8], beta[:, :, :8], output_final_state=True)
        >>> out, _ = delta_rule_step(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], beta[:, :, 8:], None, state)
        >>> torch.allclose(out, delta_rule_chunked(q, k, v, beta)[0][:, :, 8:], atol=1e-5)
        True
    """
    out_dtype = v.dtype
    q, k, v, beta, g = masked_inputs(q, k, v, beta, g, valid)
    S = _initial_memory(state, q, v, q.dtype)
    S = S * g[..., None].exp()
    read = k @ S  # (B, H, 1, D)
    S = S + k.transpose(-1, -2) @ (beta[..., None] * (v - read))
    out = scale * (q @ S)
    if valid is not None:
        out = out.masked_fill(~valid[:, None, :, None].to(out.device), 0.0)
    return out.to(out_dtype), DeltaState(S)
