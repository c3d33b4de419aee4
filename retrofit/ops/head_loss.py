"""LM-head training losses without logits: next-token cross-entropy and KL to a teacher, with gradients.

A training step's head is a GEMM against a (V, D) weight with V = 262k for Gemma. Run as slices of
positions (``head(hidden[:, s:e])``), each slice is a short-and-wide GEMM that streams the whole
weight for a few dozen rows: on a CPU it runs at half the FLOP rate of the model's other GEMMs, and
every slice also materialises, log-softmaxes and zero-fills ``(n, V)`` fp32 tensors.
:func:`linear_head_losses` instead walks tiles of ``token_block`` positions x ``vocab_block``
vocabulary rows (64 MiB of fp32 logits at the defaults), so each GEMM is large on both sides, and
folds each tile into per-position running statistics:

    z = softcap(h W^T + b),  lse_s = logsumexp_v z_v,  nll = lse_s - z_y
    KL(q || p) = sum_v q_v (log q_v - log p_v) = A - lse_t + lse_s,   A = sum_v q_v (z^t_v - z_v)

with ``q = softmax(z^t)`` the teacher's distribution (its hidden states through the same head) and
``A`` carried online against the teacher's running log-sum-exp. Backward recomputes each tile:

    dL/dz = (g_nll [y valid] + g_kl) p - g_nll onehot(y) - g_kl q,   p = exp(z - lse_s)

times ``1 - (z / cap)^2`` under a soft-cap; then ``dh += dz W_c``, ``dW_c += dz^T h``, ``db_c += sum dz``.
Nothing ``(N, V)``-sized is stored: the saved state is ``lse_s`` (and ``lse_t``) per position.
:func:`linear_head_losses_reference` is the dense form it is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "HEAD_TOKEN_BLOCK", "HEAD_VOCAB_BLOCK", "block_statistics", "linear_head_losses",
           "linear_head_losses_reference"]

IGNORE_INDEX = -100  # a target that is not scored (transformers' label convention)
HEAD_TOKEN_BLOCK = 4096
HEAD_VOCAB_BLOCK = 4096  # 4096 x 4096 fp32 logits per tile: GEMMs of >= 4096 x 640 x 4096 for Gemma


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    """Logits, log-sum-exps and accumulators: fp32, or fp64 for an fp64 head (gradcheck)."""
    return torch.promote_types(weight.dtype, torch.float32)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    z = F.linear(h, weight, bias).to(_acc_dtype(weight))
    if softcap and z.requires_grad:  # the dense reference, under autograd
        return torch.tanh(z / softcap) * softcap
    if softcap:  # a fresh tile inside the op: in place, no (P, V) temporaries
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def linear_head_losses_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    teacher: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense form: whole fp32 logits ``(N, V)``, then the summed KL to the teacher and NLL.

    Args:
        hidden, weight, targets, teacher, bias, softcap: as :func:`linear_head_losses`.

    Returns:
        ``(kl_sum, nll_sum)``: fp32 scalars summed over positions (fp64 for an fp64 weight, as
        every fp32 quantity here).

    Example:
        >>> import torch
        >>> from retrofit.ops import linear_head_losses_reference
        >>> targets = torch.tensor([0, 3, -100, 2, 2])  # -100: not scored
        >>> kl, nll = linear_head_losses_reference(torch.randn(5, 8), torch.randn(11, 8), targets)
        >>> kl.item(), nll.shape
        (0.0, torch.Size([]))
    """
    logp = torch.log_softmax(_logits(hidden.to(weight.dtype), weight, bias, softcap), dim=-1)
    zero = logp.new_zeros(())
    nll = zero if targets is None else F.nll_loss(logp, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    if teacher is None:
        return zero, nll
    with torch.no_grad():
        logq = torch.log_softmax(_logits(teacher.to(weight.dtype), weight, bias, softcap), dim=-1)
    return F.kl_div(logp, logq, log_target=True, reduction="sum"), nll


def _check(hidden, weight, targets, teacher, bias, token_block, vocab_block) -> None:
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden (N, D) and weight (V, D); got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets is not None and targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected targets (N,) = ({hidden.shape[0]},); got {tuple(targets.shape)}")
    if teacher is not None and teacher.shape != hidden.shape:
        raise ValueError(f"expected teacher {tuple(hidden.shape)} like hidden; got {tuple(teacher.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"expected bias ({weight.shape[0]},); got {tuple(bias.shape)}")
    if token_block < 1 or vocab_block < 1:
        raise ValueError("token_block and vocab_block must be positive")
    if targets is not None and targets.numel():
        scored = targets[targets != IGNORE_INDEX]
        if scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= weight.shape[0]):
            raise ValueError(f"targets must lie in [0, {weight.shape[0]}) or be {IGNORE_INDEX}; "
                             f"got {int(scored.min())} .. {int(scored.max())}")


def block_statistics(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    vocab_block: int,
    targets: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One block of positions through the head, ``vocab_block`` rows of the weight at a time.

    h ``(P, D)`` (and teacher ``(P, D)``) in the weight's dtype; targets ``(P,)`` (any value outside
    ``[0, V)`` picks nothing). Returns ``(lse, target_logit, teacher_lse, gap)``, each ``(P,)`` in
    the accumulation dtype: the student's log-sum-exp, the logit at each target (0 where none), and
    with a teacher its log-sum-exp and ``sum_v q_v (z^t_v - z_v)`` (else None). The target logit comes
    from the tile that also feeds the log-sum-exp, so it carries the same rounding.
    """
    P, V = h.shape[0], weight.shape[0]
    acc_kw = dict(dtype=_acc_dtype(weight), device=h.device)
    lse, picked = torch.full((P,), float("-inf"), **acc_kw), torch.zeros(P, **acc_kw)
    lse_t = gap = None
    if teacher is not None:
        lse_t, gap = torch.full((P,), float("-inf"), **acc_kw), torch.zeros(P, **acc_kw)
    for v0 in range(0, V, vocab_block):
        v1 = min(V, v0 + vocab_block)
        w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
        z = _logits(h, w, b, softcap)
        lse = torch.logaddexp(lse, torch.logsumexp(z, dim=1))
        if targets is not None:
            here = (targets >= v0) & (targets < v1)
            got = z.gather(1, (targets - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0]
            picked = torch.where(here, got, picked)
        if teacher is not None:
            zt = _logits(teacher, w, b, softcap)
            lse_c = torch.logsumexp(zt, dim=1)
            diff = zt - z
            # this tile's sum_v q_v (z^t_v - z_v) with q normalised within the tile, then rescaled
            # from the tile's normaliser to the running one
            gap_c = zt.sub_(lse_c[:, None]).exp_().mul_(diff).sum(1)
            new_t = torch.logaddexp(lse_t, lse_c)
            gap = gap * torch.exp(lse_t - new_t) + gap_c * torch.exp(lse_c - new_t)
            lse_t = new_t
    return lse, picked, lse_t, gap


class _LinearHeadLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher, softcap, token_block, vocab_block):
        N = hidden.shape[0]
        h_all = hidden.to(weight.dtype)
        t_all = None if teacher is None else teacher.to(weight.dtype)
        f32 = dict(dtype=_acc_dtype(weight), device=hidden.device)
        lse_s = torch.empty(N, **f32)
        lse_t = None if teacher is None else torch.empty(N, **f32)
        kl_sum, nll_sum = torch.zeros((), **f32), torch.zeros((), **f32)
        for s in range(0, N, token_block):
            e = min(N, s + token_block)
            y = None if targets is None else targets[s:e]
            run_s, picked, run_t, gap = block_statistics(
                h_all[s:e], weight, bias, softcap, vocab_block, y, None if t_all is None else t_all[s:e])
            lse_s[s:e] = run_s
            if y is not None:
                valid = y != IGNORE_INDEX
                nll_sum = nll_sum + torch.where(valid, run_s - picked, 0.0).sum()
            if t_all is not None:
                lse_t[s:e] = run_t
                kl_sum = kl_sum + (gap - run_t + run_s).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, teacher, lse_s, lse_t)
        ctx.softcap, ctx.token_block, ctx.vocab_block = softcap, token_block, vocab_block
        return kl_sum, nll_sum

    @staticmethod
    def backward(ctx, g_kl, g_nll):
        hidden, weight, bias, targets, teacher, lse_s, lse_t = ctx.saved_tensors
        cap, token_block, vocab_block = ctx.softcap, ctx.token_block, ctx.vocab_block
        N, V = hidden.shape[0], weight.shape[0]
        want_h, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        h_all = hidden.to(weight.dtype)
        t_all = None if teacher is None else teacher.to(weight.dtype)
        acc = _acc_dtype(weight)
        g_kl = g_kl.to(acc) if teacher is not None else None
        g_nll = g_nll.to(acc) if targets is not None else None
        grad_h = torch.zeros(N, hidden.shape[1], dtype=acc, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_b = torch.zeros(V, dtype=acc, device=weight.device) if want_b else None
        for s in range(0, N, token_block):
            e = min(N, s + token_block)
            h = h_all[s:e]
            coef = torch.zeros(e - s, dtype=acc, device=hidden.device)  # weight of p per row
            y = rows = None
            if g_nll is not None:
                y = targets[s:e]
                valid = y != IGNORE_INDEX
                coef = coef + valid.float() * g_nll
            if g_kl is not None:
                coef = coef + g_kl
            for v0 in range(0, V, vocab_block):
                v1 = min(V, v0 + vocab_block)
                w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
                z = _logits(h, w, b, cap)
                slope = 1 - (z / cap) ** 2 if cap else None
                dz = z.sub_(lse_s[s:e, None]).exp_().mul_(coef[:, None])
                if y is not None:
                    rows = torch.nonzero(valid & (y >= v0) & (y < v1), as_tuple=True)[0]
                    dz[rows, y[rows] - v0] -= g_nll
                if g_kl is not None:
                    zt = _logits(t_all[s:e], w, b, cap)
                    dz.sub_(zt.sub_(lse_t[s:e, None]).exp_().mul_(g_kl))
                if slope is not None:
                    dz.mul_(slope)
                dz_w = dz.to(weight.dtype)
                if grad_h is not None:
                    grad_h[s:e] += (dz_w @ w).to(acc)
                if grad_w is not None:
                    grad_w[v0:v1] += (dz_w.t() @ h).to(acc)
                if grad_b is not None:
                    grad_b[v0:v1] += dz.sum(0)
        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None)


def linear_head_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    teacher: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    token_block: int = HEAD_TOKEN_BLOCK,
    vocab_block: int = HEAD_VOCAB_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled, differentiable form of :func:`linear_head_losses_reference`.

    Never more than ``token_block x vocab_block`` logits are alive.
    Gradients flow to ``hidden``, ``weight`` and ``bias`` (whichever require them), not to
    ``teacher``. The matmuls run in the weight's dtype as the model's head does; logits, the
    log-sum-exps and the gradient accumulators are fp32.

    Args:
        hidden: ``(N, D)`` the student's final hidden states.
        weight: ``(V, D)`` the LM head.
        targets: ``(N,)`` long in ``[0, V)`` or ``IGNORE_INDEX`` (not scored); None: ``nll_sum`` is 0.
        teacher: ``(N, D)`` the teacher's hidden states through the same head, no gradient;
            None: ``kl_sum`` is 0.
        bias: ``(V,)`` or None.
        softcap: ``softcap * tanh(logit / softcap)`` when set.
        token_block: positions per tile.
        vocab_block: vocabulary rows per tile.

    Returns:
        ``(kl_sum, nll_sum)``: fp32 scalars summed over positions.

    Example:
        >>> import torch
        >>> from retrofit.ops import linear_head_losses
        >>> h = torch.randn(5, 8, requires_grad=True)
        >>> kl, nll = linear_head_losses(h, torch.randn(11, 8), torch.tensor([0, 3, 10, 2, 2]), torch.randn(5, 8),
        ...                              token_block=2, vocab_block=4)
        >>> (kl + nll).backward()
        >>> h.grad.shape
        torch.Size([5, 8])
    """
    _check(hidden, weight, targets, teacher, bias, token_block, vocab_block)
    if teacher is not None:
        teacher = teacher.detach()
    return _LinearHeadLosses.apply(hidden, weight, bias, targets, teacher, softcap, int(token_block),
                                   int(vocab_block))
