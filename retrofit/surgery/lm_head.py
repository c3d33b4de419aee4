"""The LM head of a (converted) causal LM, run one slice of positions at a time.

A full forward with ``labels`` materialises ``(B, T, V)`` fp32 logits: 17 GB for one 16K-token
Gemma 3 sequence (V = 262k). Here the decoder runs with one head position, its final normed
hidden states are captured, and the head, the optional final soft-cap and the losses run on at
most ``logit_budget`` logits at a time: a plain linear head through the tiled op
:func:`retrofit.ops.head_loss.linear_head_losses` (tiles of positions x vocabulary rows, each
recomputed in backward, so every GEMM is large on both sides), any other head (PEFT-wrapped,
ZeRO-3-partitioned) as slices of positions through the module itself.

Used by the trainer's objectives (``retrofit.train.objectives``) and by ``retrofit bench model
--loss sliced``; the numbers equal the model's own loss (tested).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from retrofit.ops.head_loss import HEAD_VOCAB_BLOCK, IGNORE_INDEX, linear_head_losses

__all__ = ["DEFAULT_LOGIT_BUDGET", "capture_final_hidden", "final_softcap", "head_logits_fn",
           "sliced_head_terms", "sliced_lm_loss", "unwrap_causal_lm"]

DEFAULT_LOGIT_BUDGET = 1 << 24  # fp32 logits per tile or slice (64 MiB); the KL holds ~4 at once


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers CausalLM under PEFT / DeepSpeed / accelerate wrappers."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def final_softcap(causal_lm: nn.Module) -> float | None:
    """Gemma 2's final logit soft-cap (None where the family has none)."""
    return getattr(causal_lm.config, "final_logit_softcapping", None)


def head_logits_fn(causal_lm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``hidden (..., D) -> fp32 logits (..., V)``: the output embedding, then the soft-cap if any."""
    head = causal_lm.get_output_embeddings()
    cap = final_softcap(causal_lm)

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = head(hidden).float()
        return torch.tanh(out / cap) * cap if cap else out

    return logits


@contextlib.contextmanager
def capture_final_hidden(causal_lm: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects the decoder's final (normed) hidden states ``(B, T, D)`` of the next forward: ``box[0]``."""
    box: list[torch.Tensor] = []
    decoder = causal_lm.get_decoder()

    def hook(_module, _args, output):
        box.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder.register_forward_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


def sliced_head_terms(causal_lm: nn.Module, student: torch.Tensor, teacher: torch.Tensor | None,
                      targets: torch.Tensor | None, *, logit_budget: int = DEFAULT_LOGIT_BUDGET
                      ) -> dict[str, torch.Tensor]:
    """Mean KL(teacher || student) and/or next-token CE over positions, one slice of logits at a time.

    student / teacher: final hidden states ``(B, T, D)`` (``teacher`` None: no ``"kl"`` term);
    targets ``(B, N <= T)``: the next token of each of the first N positions (the rest have none
    and enter only the KL; None: no ``"lm"`` term). Returns ``{"kl": ..., "lm": ...}`` as present.
    """
    B, T, _ = student.shape
    N = 0 if targets is None else targets.shape[1]
    want_kl, want_lm = teacher is not None, targets is not None
    if not (want_kl or want_lm):
        raise ValueError("sliced_head_terms needs a teacher (kl), targets (lm) or both")
    head = causal_lm.get_output_embeddings()
    if _plain_linear(head):
        return _tiled_head_terms(head, final_softcap(causal_lm), student, teacher, targets, int(logit_budget))
    logits_of = head_logits_fn(causal_lm)
    vocab = head.weight.shape[0]
    step = max(1, int(logit_budget) // max(1, vocab * B))

    def piece(hs: torch.Tensor, ht: torch.Tensor | None, tgt: torch.Tensor | None, n_pred: int) -> torch.Tensor:
        logp = torch.log_softmax(logits_of(hs), dim=-1)
        out = []
        if want_kl:
            with torch.no_grad():
                logq = torch.log_softmax(logits_of(ht), dim=-1)
            out.append(F.kl_div(logp, logq, log_target=True, reduction="sum"))
        if want_lm:
            lp = logp[:, :n_pred]
            out.append(F.nll_loss(lp.reshape(-1, lp.shape[-1]), tgt.reshape(-1), reduction="sum"))
        return torch.stack(out)

    sums = None
    for s in range(0, T, step):
        e = min(T, s + step)
        n_pred = max(0, min(e, N) - s)  # positions in this slice that have a next token
        args = (student[:, s:e], None if teacher is None else teacher[:, s:e],
                None if targets is None else targets[:, s:s + n_pred], n_pred)
        val = checkpoint(piece, *args, use_reentrant=False) if student.requires_grad else piece(*args)
        sums = val if sums is None else sums + val
    out, i = {}, 0
    if want_kl:
        out["kl"] = sums[i] / (B * T)
        i += 1
    if want_lm:
        out["lm"] = sums[i] / (B * N)
    return out


def _plain_linear(head: nn.Module) -> bool:
    """A bias-optional ``nn.Linear`` whose weight is all here (not a PEFT wrapper, not a ZeRO-3 shard)."""
    return isinstance(head, nn.Linear) and getattr(head.weight, "ds_id", None) is None


def _tiled_head_terms(head: nn.Linear, softcap: float | None, student: torch.Tensor, teacher: torch.Tensor | None,
                      targets: torch.Tensor | None, logit_budget: int) -> dict[str, torch.Tensor]:
    """:func:`sliced_head_terms` through the tiled op: positions flattened, the target-less ones ignored."""
    B, T, D = student.shape
    vocab_block = max(1, min(head.weight.shape[0], HEAD_VOCAB_BLOCK, logit_budget))
    token_block = max(1, logit_budget // vocab_block)
    flat_targets = None
    if targets is not None:
        flat_targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long, device=student.device)
        flat_targets[:, : targets.shape[1]] = targets
        flat_targets = flat_targets.reshape(B * T)
    kl, nll = linear_head_losses(
        student.reshape(B * T, D), head.weight, flat_targets,
        None if teacher is None else teacher.reshape(B * T, D),
        bias=head.bias, softcap=softcap, token_block=token_block, vocab_block=vocab_block,
    )
    out = {}
    if teacher is not None:
        out["kl"] = kl / (B * T)
    if targets is not None:
        out["lm"] = nll / (B * targets.shape[1])
    return out


def sliced_lm_loss(model: nn.Module, input_ids: torch.Tensor, *,
                   logit_budget: int = DEFAULT_LOGIT_BUDGET) -> torch.Tensor:
    """Mean next-token cross-entropy of ``input_ids`` ``(B, T)``: ``model(input_ids, labels=input_ids)
    .loss`` without ever holding more than ``logit_budget`` logits. ``model`` may be wrapped."""
    causal_lm = unwrap_causal_lm(model)
    with capture_final_hidden(causal_lm) as box:
        model(input_ids=input_ids, logits_to_keep=1)
    return sliced_head_terms(causal_lm, box[0], None, input_ids[:, 1:], logit_budget=logit_budget)["lm"]
