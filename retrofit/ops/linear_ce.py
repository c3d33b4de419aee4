"""Per-token cross-entropy of an LM head without materialising the logits (inference).

Scoring long windows is dominated by the head when the vocabulary is large: Gemma's 262k-token
head costs 2 * 262144 * 640 FLOP per position, more than the rest of Gemma 3 270M together, and a
slice of 256 positions holds 256 MiB of fp32 logits. :func:`linear_cross_entropy` computes

    nll_t = logsumexp_v(z_tv) - z_t,y_t,    z = softcap(h W^T + b)

in blocks of ``token_block`` positions x ``vocab_block`` vocabulary rows: each block's logits
(16 MiB at the defaults) are folded into a running log-sum-exp while they are still in cache,
and the target logit is gathered from the block that holds it (so it carries exactly the same
rounding as the normaliser); the block routine is the training losses' own
(:func:`retrofit.ops.head_loss.block_statistics`). Forward only, per token, no ignore_index.
:func:`linear_cross_entropy_reference` is the dense form it is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from retrofit.ops.head_loss import block_statistics

TOKEN_BLOCK = 2048
VOCAB_BLOCK = 2048

__all__ = ["TOKEN_BLOCK", "VOCAB_BLOCK", "linear_cross_entropy", "linear_cross_entropy_reference"]


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense form: full fp32 logits ``(N, V)``, then cross-entropy.

    Args:
        hidden, weight, targets, bias, softcap: as :func:`linear_cross_entropy`.

    Returns:
        ``(N,)`` fp32 negative log-likelihoods.

    Example:
        >>> import torch
        >>> from retrofit.ops import linear_cross_entropy_reference
        >>> h, w, y = torch.randn(5, 8), torch.randn(11, 8), torch.tensor([0, 3, 10, 2, 2])
        >>> linear_cross_entropy_reference(h, w, y).shape
        torch.Size([5])
    """
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, reduction="none")


@torch.no_grad()
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    token_block: int = TOKEN_BLOCK,
    vocab_block: int = VOCAB_BLOCK,
) -> torch.Tensor:
    """Blocked form of :func:`linear_cross_entropy_reference`.

    Never more than ``token_block x vocab_block`` logits are alive. The matmul runs in the
    weight's dtype (as the model's head does); the softcap, the log-sum-exp and the result are
    fp32. Runs without autograd (evaluation).

    Args:
        hidden: ``(N, D)`` final hidden states.
        weight: ``(V, D)`` the LM head.
        targets: ``(N,)`` long, every one in ``[0, V)``.
        bias: ``(V,)`` or None.
        softcap: ``softcap * tanh(logit / softcap)`` when set.
        token_block: positions per tile.
        vocab_block: vocabulary rows per tile.

    Returns:
        ``(N,)`` fp32 negative log-likelihoods.

    Example:
        >>> import torch
        >>> from retrofit.ops import linear_cross_entropy, linear_cross_entropy_reference
        >>> h, w, y = torch.randn(5, 8), torch.randn(11, 8), torch.tensor([0, 3, 10, 2, 2])
        >>> nll = linear_cross_entropy(h, w, y, token_block=2, vocab_block=4)
        >>> nll.shape, torch.allclose(nll, linear_cross_entropy_reference(h, w, y), atol=1e-5)
        (torch.Size([5]), True)
    """
    if (hidden.ndim != 2 or weight.ndim != 2 or targets.shape != hidden.shape[:1]
            or hidden.shape[1] != weight.shape[1]):
        raise ValueError(
            f"expected hidden (N, D), weight (V, D), targets (N,); got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if token_block < 1 or vocab_block < 1:
        raise ValueError("token_block and vocab_block must be positive")
    N, V = hidden.shape[0], weight.shape[0]
    if N and (int(targets.min()) < 0 or int(targets.max()) >= V):  # no ignore_index: every target is scored
        raise ValueError(f"targets must lie in [0, {V}); got {int(targets.min())} .. {int(targets.max())}")
    hidden = hidden.to(weight.dtype)
    out = torch.empty(N, dtype=torch.float32, device=hidden.device)
    for s in range(0, N, token_block):
        lse, target_logit, _, _ = block_statistics(
            hidden[s : s + token_block], weight, bias, softcap, vocab_block, targets[s : s + token_block])
        out[s : s + token_block] = lse - target_logit
    return out
