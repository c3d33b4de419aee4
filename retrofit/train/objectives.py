"""Training objectives: next-token loss, attention transfer and KL to the original model.

``train.objective`` (a recipe key) is one of

* ``lm``: next-token cross-entropy (what the model's forward returns with ``labels``);
* ``attention``: each converted layer's output vs the frozen original attention of the same
  layer on the original model's hidden states (relative MSE after o_proj, summed over the
  converted layers, each times its ``train.layer_weights`` weight, 1 by default; see
  ``retrofit/layers/base.py``). The LM head is never computed;
* ``kl``: KL(p_orig || p_conv) over next tokens, the teacher being the same model with its
  converted layers switched back to their original attention under ``no_grad``. Logits live
  one slice of positions at a time (recomputed in backward), never whole;
* ``weights``: each converted layer's attention weights vs the frozen original attention's on
  the original model's hidden states: KL(softmax || layer) over the keys of ``train.weights_queries``
  query rows per sequence, averaged over rows and heads and summed over the layers (each times its
  ``train.layer_weights`` weight). For methods whose output is an explicit distribution over the
  keys (``hedgehog``: the window at ``1 - p``, the read's kernel weights at ``p``), it trains the
  feature maps and the share's scale together: Hedgehog's and LoLCATs' attention-weight
  distillation, with no output projection, no values and no LM head;
* ``recall``: next-token cross-entropy of the recall answers' value tokens only (the positions
  ``data.recall`` marks, :meth:`retrofit.data.recall.RecallInserter.answer_mask`), end to end
  through the converted model: retrieval beyond the window trained directly, with no teacher;
* ``mix``: ``sum_k train.objective_weights[k] * loss_k`` over any of the five.

``data.recall.answer_weight`` > 1 weighs the answers' positions up in the ``attention`` term instead.

``train.head_positions: n`` runs the LM head (for ``kl`` and ``lm``) on n positions per sequence,
sampled without replacement from those that have a next token, instead of all T: an unbiased
estimate of the mean per-token term at n/T of the head's cost (for Gemma 3's 262k vocabulary the
head is most of a KL step). The sample is a function of the batch's tokens, so a resumed run
draws the same positions.

Every objective returns ``(loss, parts)``: the scalar to back-propagate and each term's value.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import nn

from retrofit.errors import SpecError
from retrofit.layers.base import DEFAULT_TRANSFER_QUERIES
from retrofit.ops import linear_cross_entropy
from retrofit.surgery.distill import distill_mode
from retrofit.surgery.lm_head import (
    DEFAULT_LOGIT_BUDGET, capture_final_hidden, final_softcap, sliced_head_terms, unwrap_causal_lm,
)

__all__ = ["OBJECTIVES", "TERMS", "Objective", "heldout_nll", "layer_weights", "objective_weights"]

TERMS = ("lm", "attention", "weights", "kl", "recall")
OBJECTIVES = TERMS + ("mix",)


def objective_weights(objective: str, weights: dict | None = None) -> dict[str, float]:
    """``{term: weight}`` for a recipe's ``train.objective`` / ``train.objective_weights``."""
    weights = dict(weights or {})
    if objective not in OBJECTIVES:
        raise SpecError(f"train.objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if objective != "mix":
        if weights:
            raise SpecError(f"train.objective_weights is only read with train.objective=mix (got objective {objective!r})")
        return {objective: 1.0}
    unknown = set(weights) - set(TERMS)
    if unknown:
        raise SpecError(f"train.objective_weights: unknown term(s) {', '.join(sorted(unknown))}; terms: {', '.join(TERMS)}")
    out = {}
    for k, v in weights.items():
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise SpecError(f"train.objective_weights.{k} must be a number, got {v!r}") from None
        if not v >= 0.0 or v == float("inf"):
            raise SpecError(f"train.objective_weights.{k} must be a finite number >= 0, got {v}")
        if v > 0:
            out[k] = v
    if not out:
        raise SpecError("train.objective=mix needs train.objective_weights with at least one positive weight, "
                        "e.g. {attention: 1.0, kl: 0.1}")
    return out


def layer_weights(spec: dict | None) -> dict[int, float]:
    """``{layer index: weight}`` from a recipe's ``train.layer_weights`` (``{"13-29": 4.0, "0": 0.5}``:
    keys are layer lists as ``conversion.layers`` takes them; layers not named weigh 1)."""
    from retrofit.surgery.spec import parse_layers

    out: dict[int, float] = {}
    for key, value in (spec or {}).items():
        layers = parse_layers(str(key))
        if isinstance(layers, str):
            raise SpecError(f"train.layer_weights: name layers by index ('13-29', '0,4'), not {key!r}")
        try:
            weight = float(value)
        except (TypeError, ValueError):
            raise SpecError(f"train.layer_weights.{key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not (weight >= 0.0 and math.isfinite(weight)):
            raise SpecError(f"train.layer_weights.{key} must be a finite number >= 0, got {value!r}")
        twice = sorted(set(layers) & set(out))
        if twice:
            raise SpecError(f"train.layer_weights: layer(s) {', '.join(map(str, twice))} named twice")
        out.update({i: weight for i in layers})
    return out


class Objective:
    """Computes a recipe's training loss for one micro-batch of packed token ids ``(B, T)``."""

    def __init__(self, weights: dict[str, float], *, logit_budget: int = DEFAULT_LOGIT_BUDGET,
                 head_positions: int | None = None, sliced_head: bool = False,
                 layer_weights: dict[int, float] | None = None, answer_weight: float = 1.0,
                 weights_queries: int | None = None):
        """``sliced_head``: the lm-only objective, too, runs the head one slice of ``logit_budget``
        logits at a time (as kl and mix always do) instead of the model's own loss, whose
        ``(B, T, V)`` logits are 17 GB of fp32 for one 16K-token Gemma 3 sequence.
        ``layer_weights``: ``{layer index: weight}`` of the attention term's per-layer losses (1 if absent).
        ``answer_weight``: the attention term's weight of the positions an answer mask marks (others 1).
        ``weights_queries``: query rows per sequence of the weights term (None: the layers' default)."""
        self.weights = dict(weights)
        self.layer_weights = dict(layer_weights or {})
        self.answer_weight = float(answer_weight)
        self.weights_queries = DEFAULT_TRANSFER_QUERIES if weights_queries is None else int(weights_queries)
        self.logit_budget = int(logit_budget)
        self.head_positions = head_positions
        self.sliced_head = sliced_head

    @property
    def name(self) -> str:
        return "+".join(f"{w:g}*{k}" if len(self.weights) > 1 else k for k, w in self.weights.items())

    def __call__(self, model: nn.Module, input_ids: torch.Tensor, answer_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """``model``: what the training loop calls (the DeepSpeed engine or a plain module);
        ``answer_mask``: ``(B, T)`` bool, the positions that predict a recall answer's value tokens
        (``data.recall``; needed by the ``recall`` term and by ``answer_weight``);
        ``position_ids``: ``(B, T)`` positions that restart at each packed document
        (``data.document_boundaries``, :func:`retrofit.data.packing.document_positions`), handed to
        every forward (student and teacher read each document alone); None: the model's own."""
        pos = {} if position_ids is None else {"position_ids": position_ids}
        if "recall" in self.weights and answer_mask is None:
            raise SpecError("the recall objective term needs the recall answers' positions: set data.recall.share > 0")
        if self.weights == {"lm": 1.0} and not self.sliced_head:  # the model's own loss, bit for bit
            loss = model(input_ids=input_ids, labels=input_ids, **pos).loss
            return loss, {"lm": float(loss.detach())}
        causal_lm = unwrap_causal_lm(model)
        total, parts = None, {}
        if "attention" in self.weights:
            position_weights = None
            if answer_mask is not None and self.answer_weight != 1.0:
                position_weights = 1.0 + (self.answer_weight - 1.0) * answer_mask.float()
            with distill_mode(causal_lm, "transfer", position_weights=position_weights) as modules:
                model(input_ids=input_ids, logits_to_keep=1, **pos)  # decoder on teacher states; 1 head position
                terms = [(int(m.layer_idx), m.transfer_loss) for m in modules if m.transfer_loss is not None]
            att = self._layer_sum(terms)
            parts["attention"] = float(att.detach())
            total = self.weights["attention"] * att
        if "weights" in self.weights:
            with distill_mode(causal_lm, "weights", queries=self.weights_queries) as modules:
                model(input_ids=input_ids, logits_to_keep=1, **pos)
                terms = [(int(m.layer_idx), m.transfer_loss) for m in modules if m.transfer_loss is not None]
            kl = self._layer_sum(terms)
            parts["weights"] = float(kl.detach())
            total = self.weights["weights"] * kl if total is None else total + self.weights["weights"] * kl
        if "kl" in self.weights or "lm" in self.weights or "recall" in self.weights:
            teacher = None
            if "kl" in self.weights:
                with torch.no_grad(), distill_mode(causal_lm, "teacher"), capture_final_hidden(causal_lm) as box:
                    model(input_ids=input_ids, logits_to_keep=1, **pos)
                teacher = box[0].detach()
            with capture_final_hidden(causal_lm) as box:
                model(input_ids=input_ids, logits_to_keep=1, **pos)
            student = box[0]
            terms = {}
            if "recall" in self.weights:
                terms["recall"] = self._recall_term(causal_lm, student, input_ids, answer_mask)
            if "kl" in self.weights or "lm" in self.weights:
                targets = input_ids[:, 1:]
                idx = self.sampled_positions(input_ids)
                if idx is not None:
                    student, targets = student[:, idx], input_ids[:, idx + 1]
                    teacher = None if teacher is None else teacher[:, idx]
                terms.update(sliced_head_terms(causal_lm, student, teacher, targets if "lm" in self.weights else None,
                                               logit_budget=self.logit_budget))
            for term, value in terms.items():
                parts[term] = float(value.detach())
                total = self.weights[term] * value if total is None else total + self.weights[term] * value
        return total, parts

    def _layer_sum(self, terms: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """``sum_i layer_weights[i] * loss_i`` over the converted layers' per-layer terms."""
        return torch.stack([t * self.layer_weights.get(i, 1.0) for i, t in terms]).sum()

    def _recall_term(self, causal_lm: nn.Module, student: torch.Tensor, input_ids: torch.Tensor,
                     answer_mask: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the ``answer_mask`` positions of ``student`` ``(B, T, D)``
        (0, with a graph, for a batch without answers: every rank still runs the same backward)."""
        T = input_ids.shape[1]
        mask = answer_mask[:, : T - 1].to(student.device).bool()  # the last position has no next token
        if not bool(mask.any()):
            return student.sum() * 0.0
        hidden = student[:, : T - 1][mask][None]  # (1, N, D)
        targets = input_ids[:, 1:][mask][None]  # (1, N)
        return sliced_head_terms(causal_lm, hidden, None, targets, logit_budget=self.logit_budget)["lm"]

    def sampled_positions(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Sorted positions ``(n,)`` the head runs on (``head_positions`` of the T-1 with a next token),
        or None for all. Seeded by the tokens, so the same batch always draws the same positions."""
        T = input_ids.shape[1]
        if not self.head_positions or self.head_positions >= T - 1:
            return None
        seed = int(input_ids.long().sum().item()) * 1_000_003 + T
        g = torch.Generator().manual_seed(seed % (2**63 - 1))
        idx = torch.randperm(T - 1, generator=g)[: self.head_positions].sort().values
        return idx.to(input_ids.device)


@torch.no_grad()
def heldout_nll(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    gather: Callable[[list[torch.Tensor]], contextlib.AbstractContextManager] | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[float, int]:
    """Summed next-token NLL of ``input_ids`` ``(B, T)`` and the number of targets ``B (T - 1)``.

    The held-out loss of a training run: the same number as ``model(input_ids, labels=input_ids)
    .loss`` times the count, but the decoder runs with one head position and a linear head is
    applied blockwise (:func:`retrofit.ops.linear_cross_entropy`), so no ``(B, T, V)`` logits
    (4 GiB for one 4096-token Gemma sequence) and no graph. ``gather``: a context manager factory
    that materialises partitioned parameters (ZeRO-3) around the head's weight. ``position_ids``:
    ``(B, T)`` positions restarting at each packed document, as :class:`Objective` takes them.
    """
    pos = {} if position_ids is None else {"position_ids": position_ids}
    causal_lm = unwrap_causal_lm(model)
    head = causal_lm.get_output_embeddings()
    n = input_ids.shape[0] * (input_ids.shape[1] - 1)
    if not isinstance(head, nn.Linear):  # e.g. a PEFT-wrapped head: the model's own loss
        return float(model(input_ids=input_ids, labels=input_ids, **pos).loss) * n, n
    with capture_final_hidden(causal_lm) as box:
        model(input_ids=input_ids, logits_to_keep=1, **pos)
    hidden = box[0][:, :-1]
    cap = final_softcap(causal_lm)
    with gather([head.weight]) if gather is not None else contextlib.nullcontext():
        nll = linear_cross_entropy(
            hidden.reshape(n, hidden.shape[-1]), head.weight, input_ids[:, 1:].reshape(n),
            bias=head.bias, softcap=cap,
        )
    return float(nll.double().sum()), n
