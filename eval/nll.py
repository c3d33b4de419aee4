"""Memory-bounded negative log-likelihood of long token windows.

The logits of a 32K-token window over a 262k vocabulary would take 34 GB in fp32, so the model
is run up to its final hidden states (after the final norm) and ``lm_head`` + cross-entropy are
applied in blocks of ``slice_tokens`` positions x a slice of the vocabulary
(:func:`retrofit.ops.linear_ce.linear_cross_entropy`), never as whole logits. Optionally the
forward itself is chunked: ``chunk_size`` tokens at a time, carrying the model's cache (for a
converted model, its constant-memory recurrent state + sliding-window ring buffer; for a plain
transformers model, its KV cache), which gives the same result as one forward.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from retrofit.layers.cache import cache_keyword, output_cache
from retrofit.surgery.rope_scaling import dynamic_rope_held_at

DEFAULT_LOGIT_BUDGET = 1 << 26  # elements of fp32 logits alive at once (256 MiB)


def decoder_module(model: Any):
    """The module mapping input_ids to final (normed) hidden states: ``model.model`` for CausalLMs."""
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module):
        return inner
    return model.get_decoder()


def _softcap(model: Any) -> float | None:
    cfg = model.config
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is None and hasattr(cfg, "get_text_config"):
        cap = getattr(cfg.get_text_config(), "final_logit_softcapping", None)
    return float(cap) if cap else None


def head_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``lm_head`` (+ Gemma's final logit soft-capping) on hidden states [..., D] -> fp32 [..., V]."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = _softcap(model)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def slice_tokens_for(vocab_size: int, budget_elements: int = DEFAULT_LOGIT_BUDGET) -> int:
    """Positions per head block so one block of logits (``positions x min(V, VOCAB_BLOCK)``) holds
    about ``budget_elements`` values, capped at :data:`retrofit.ops.linear_ce.TOKEN_BLOCK` (larger
    blocks only leave the cache)."""
    from retrofit.ops.linear_ce import TOKEN_BLOCK, VOCAB_BLOCK

    return max(1, min(TOKEN_BLOCK, budget_elements // max(1, min(vocab_size, VOCAB_BLOCK))))


@torch.no_grad()
def sliced_token_nll(model: Any, hidden: torch.Tensor, targets: torch.Tensor, *, slice_tokens: int) -> torch.Tensor:
    """Per-token NLL [B, T] (float64, on CPU) of ``targets`` [B, T] given ``hidden`` [B, T, D].

    A linear head goes through :func:`retrofit.ops.linear_ce.linear_cross_entropy` (blocks of
    ``slice_tokens`` positions x ``VOCAB_BLOCK`` vocabulary rows, no full logits); any other head
    through :func:`head_logits`, ``slice_tokens`` positions at a time.
    """
    from retrofit.ops import linear_cross_entropy

    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        B, T, D = hidden.shape
        per_token = linear_cross_entropy(
            hidden.reshape(B * T, D), head.weight, targets.reshape(B * T), bias=head.bias,
            softcap=_softcap(model), token_block=slice_tokens,
        )
        return per_token.view(B, T).double().cpu()
    out = []
    for s in range(0, hidden.shape[1], slice_tokens):
        logits = head_logits(model, hidden[:, s : s + slice_tokens])
        tgt = targets[:, s : s + slice_tokens]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
        out.append(loss.view(tgt.shape).double().cpu())
        del logits
    return torch.cat(out, dim=1) if out else torch.zeros(targets.shape, dtype=torch.float64)


@torch.no_grad()
def window_token_nll(
    model: Any,
    input_ids: torch.Tensor,
    *,
    chunk_size: int | None = None,
    slice_tokens: int | None = None,
) -> torch.Tensor:
    """Next-token NLL of each of tokens 1..T-1 of a window: float64 [T-1] on CPU.

    input_ids: [T] or [1, T]. ``chunk_size``: run the forward ``chunk_size`` tokens at a time
    through the model's cache. For a causal model the first ``L-1`` entries are the NLLs of the
    window's own first ``L`` tokens (see ``score_windows``' prefix reuse).

    A model whose RoPE follows the sequence length (dynamic NTK) is scored as the window alone
    defines it: its frequencies are held at the window's length for all chunks, as one forward of
    the window would rotate them, and reset afterwards (:mod:`retrofit.surgery.rope_scaling`).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    T = input_ids.shape[1]
    if slice_tokens is None:
        slice_tokens = slice_tokens_for(model.get_output_embeddings().weight.shape[0])
    with dynamic_rope_held_at(model, T):
        if not chunk_size or chunk_size >= T:
            hidden = decoder_module(model)(input_ids=input_ids, use_cache=False).last_hidden_state
            return sliced_token_nll(model, hidden[:, :-1], input_ids[:, 1:], slice_tokens=slice_tokens)[0]
        parts = []
        for s, out in forward_chunks(model, input_ids, chunk_size):
            targets = input_ids[:, s + 1 : s + 1 + chunk_size]  # one short on the last chunk
            hidden = out.last_hidden_state[:, : targets.shape[1]]
            parts.append(sliced_token_nll(model, hidden, targets, slice_tokens=slice_tokens)[0])
            del out, hidden
        return torch.cat(parts)


def forward_chunks(model: Any, input_ids: torch.Tensor, chunk_size: int) -> Iterator[tuple[int, Any]]:
    """Run ``input_ids`` [1, T] through the decoder (no LM head) ``chunk_size`` tokens at a time,
    carrying the model's own cache; yields ``(start, output)`` per chunk, ``output``'s cache
    (:func:`retrofit.layers.cache.output_cache`) being the cache filled up to the chunk's end."""
    decoder, cache = decoder_module(model), None
    keyword = cache_keyword(decoder.forward)
    for s in range(0, input_ids.shape[1], chunk_size):
        out = decoder(input_ids=input_ids[:, s : s + chunk_size], use_cache=True, **{keyword: cache})
        cache = output_cache(out)
        yield s, out


@torch.no_grad()
def window_nll(
    model: Any,
    input_ids: torch.Tensor,
    *,
    chunk_size: int | None = None,
    slice_tokens: int | None = None,
) -> tuple[float, int]:
    """Summed next-token NLL over a window and the number of predicted tokens: (sum, T-1).

    Same arguments as :func:`window_token_nll`.
    """
    per_token = window_token_nll(model, input_ids, chunk_size=chunk_size, slice_tokens=slice_tokens)
    return float(per_token.sum()), int(per_token.numel())


@torch.no_grad()
def check_sliced_head(model: Any, input_ids: torch.Tensor, *, atol: float = 1e-3) -> bool:
    """True if decoder + :func:`head_logits` reproduces ``model(input_ids).logits`` on a short probe.

    Guards against model families that post-process logits in ways the sliced path would miss.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    device = next(model.parameters()).device
    ids = input_ids[:, :16].to(device)
    full = model(input_ids=ids, use_cache=False).logits.float()
    ours = head_logits(model, decoder_module(model)(input_ids=ids, use_cache=False).last_hidden_state)
    scale = max(1.0, full.abs().max().item())
    ok = torch.allclose(full, ours, atol=atol * scale, rtol=1e-3)
    if not ok:
        warnings.warn(
            f"{type(model).__name__}: the sliced lm_head path differs from model(...).logits "
            f"(max diff {(full - ours).abs().max().item():.3g}); falling back to full logits",
            stacklevel=2,
        )
    return ok


@torch.no_grad()
def window_token_nll_full(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference: per-token NLL [T-1] from the model's own full logits [T, V] (memory O(T * V));
    a dynamic-NTK model at the window's own frequencies, as in :func:`window_token_nll`."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    with dynamic_rope_held_at(model, input_ids.shape[1]):
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
    return F.cross_entropy(logits[0, :-1], input_ids[0, 1:], reduction="none").double().cpu()


@torch.no_grad()
def window_nll_full(model: Any, input_ids: torch.Tensor) -> tuple[float, int]:
    """Reference: NLL from the model's own full logits [T, V] (memory O(T * V); fallback and tests)."""
    per_token = window_token_nll_full(model, input_ids)
    return float(per_token.sum()), int(per_token.numel())


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp(mean NLL); inf when the mean overflows."""
    if n_tokens == 0:
        return float("nan")
    mean = nll_sum / n_tokens
    return math.exp(mean) if mean < 700 else float("inf")
