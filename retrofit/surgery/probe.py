"""Cheap sanity numbers right after a conversion: KL divergences on a short probe text.

* ``KL(base || converted)``: how far the fresh conversion is from the pretrained model.
* for a method with a window (Macchiato, delta, Hedgehog, LAVO), the SWA anchor: the same converted model with
  the latent path closed (the pretrained attention restricted to the window):
  ``KL(anchor || converted)`` isolates what the untrained states beside the window add.
* :func:`rank_layers`: ``KL(base || model with only layer i converted)`` for each candidate
  layer, so the most costly layers can stay full attention (``retrofit convert --keep-full K``).
  On the probe text this measures local modelling; on :func:`copy_probe_ids` (a random stretch
  of tokens, then the same stretch again, farther back than the window) it measures what each
  layer contributes to long-range retrieval, which a short text cannot show.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["PROBE_TEXT", "closed_latent_path", "copy_probe_ids", "kl_divergence", "log_probs", "probe_ids",
           "rank_layers"]

# Public domain (Jane Austen, Pride and Prejudice, 1813), used only to get natural token statistics.
PROBE_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him "
    "one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it "
    "is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made no "
    "answer. \"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, and I "
    "have no objection to hearing it.\" This was invitation enough. \"Why, my dear, you must know, Mrs. Long says "
    "that Netherfield is taken by a young man of large fortune from the north of England; that he came down on "
    "Monday in a chaise and four to see the place, and was so much delighted with it, that he agreed with Mr. "
    "Morris immediately; that he is to take possession before Michaelmas, and some of his servants are to be in "
    "the house by the end of next week.\" \"What is his name?\" \"Bingley.\" \"Is he married or single?\" \"Oh! "
    "Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a fine thing "
    "for our girls!\" \"How so? How can it affect them?\" \"My dear Mr. Bennet,\" replied his wife, \"how can you be "
    "so tiresome! You must know that I am thinking of his marrying one of them.\" \"Is that his design in settling "
    "here?\" \"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one of "
    "them, and therefore you must visit him as soon as he comes.\""
)


@contextlib.contextmanager
def closed_latent_path(model: nn.Module) -> Iterator[int]:
    """Temporarily close the path beside the window (``latent_path_closed``: the layer is then the pretrained
    attention over its window) in every layer that has one (the window methods', LAVO's); yields how many
    layers were closed."""
    layers = [m for m in model.modules() if hasattr(m, "latent_path_closed")]
    before = [m.latent_path_closed for m in layers]
    for m in layers:
        m.latent_path_closed = True
    try:
        yield len(layers)
    finally:
        for m, b in zip(layers, before):
            m.latent_path_closed = b


def probe_ids(tokenizer: Any, num_tokens: int, vocab_size: int, *, seed: int = 0) -> torch.Tensor:
    """``(1, num_tokens)`` ids: the probe text (repeated as needed) or random ids without a tokenizer."""
    if tokenizer is not None:
        ids: list[int] = []
        while len(ids) < num_tokens:
            ids.extend(tokenizer(PROBE_TEXT, add_special_tokens=not ids)["input_ids"])
        return torch.tensor([ids[:num_tokens]])
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=g)


def copy_probe_ids(tokenizer: Any, span: int, vocab_size: int, *, seed: int = 0) -> tuple[torch.Tensor, int]:
    """A retrieval probe: ``(1, b + 2 * span)`` ids (``b`` = 1 for a BOS, else 0), a stretch of
    ``span`` random tokens and then the same stretch again, and how many final positions to score.

    The scored positions predict the second copy's tokens; each is predictable only by retrieving
    the token ``span - 1`` positions back (an induction copy), so with ``span > window`` a
    converted layer's window branch cannot see it. Random ids exclude the special tokens.
    """
    if span < 2:
        raise ValueError(f"span must be at least 2, got {span}")
    g = torch.Generator().manual_seed(seed)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    special = [i for i in (getattr(tokenizer, "all_special_ids", None) or []) if 0 <= i < vocab_size]
    allowed[special] = False
    pool = allowed.nonzero()[:, 0]
    stretch = pool[torch.randint(0, len(pool), (span,), generator=g)]
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    head = torch.tensor([bos]) if bos is not None else torch.tensor([], dtype=torch.long)
    return torch.cat([head, stretch, stretch])[None].long(), span


@torch.no_grad()
def log_probs(model: nn.Module, ids: torch.Tensor, last: int | None = None) -> torch.Tensor:
    """fp32 log-softmax of the model's logits, ``(B, T, V)``, or of the ``last`` positions only
    (``(B, last, V)``: the head runs on those alone)."""
    device = next(model.parameters()).device
    extra = {} if last is None else {"logits_to_keep": int(last)}
    logits = model(input_ids=ids.to(device), use_cache=False, **extra).logits
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def kl_divergence(ref_log_probs: torch.Tensor, log_probs_: torch.Tensor) -> float:
    """Mean over positions of KL(ref || other), inputs are log-probabilities ``(..., V)``."""
    return float((ref_log_probs.exp() * (ref_log_probs - log_probs_)).sum(-1).mean())


def rank_layers(model: nn.Module, spec: Any, ids: torch.Tensor, last: int | None = None) -> list[dict]:
    """Zero-shot cost of converting each layer alone: ``[{layer, kl}]``, most costly first.

    Converts ``model`` in place with ``spec`` (its ``layers`` are the candidates), then for each
    converted layer runs the model with every *other* converted layer switched back to its
    original attention (``retrofit.surgery.distill``) and measures ``KL(base || model)`` on
    ``ids``. Keeping the top entries as full attention is the cheap version of the layer
    selection of the hybrid-distillation literature (which ranks after training). ``last``: score
    only the final ``last`` positions (the second copy of :func:`copy_probe_ids`).
    """
    from retrofit.surgery.convert import convert
    from retrofit.surgery.converted import is_converted
    from retrofit.surgery.distill import converted_modules, distill_mode

    if is_converted(model):
        raise ValueError("rank_layers needs the base model (it converts the candidate layers itself)")
    base = log_probs(model, ids, last)
    convert(model, spec)
    ranking = []
    with distill_mode(model, "teacher") as modules:
        for module in modules:
            module.distill_mode = None
            ranking.append({"layer": int(module.layer_idx), "kl": kl_divergence(base, log_probs(model, ids, last))})
            module.distill_mode = "teacher"
    assert len(ranking) == len(converted_modules(model))
    return sorted(ranking, key=lambda r: -r["kl"])
