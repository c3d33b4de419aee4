"""An lm-eval model whose answers are known, for exact-score tests of the harness's scorings.

:class:`KnownLM` answers lm-eval's requests from the documents they carry (``Instance.doc``):
``choose(doc) -> index`` picks a multiple-choice answer (its log-likelihood is highest, and it
is what the model generates for a lettered prompt, by letter or by text), ``word(doc)`` is its
last word for the books task. Every prompt it is asked to continue is kept in ``prompts``.
"""
from __future__ import annotations

from collections.abc import Callable

from lm_eval.api.model import LM

from retrofit.eval.choice_generation import LETTERS


class KnownLM(LM):
    """choose(doc) -> choice index; word(doc) -> last word; by: 'letter' or 'text' answers."""

    def __init__(self, choose: Callable[[dict], int] = lambda doc: 0,
                 word: Callable[[dict], str] = lambda doc: "", by: str = "letter") -> None:
        super().__init__()
        self.choose, self.word, self.by = choose, word, by
        self.prompts: list[str] = []

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            if "choices" in req.doc:  # one request per choice, in order (req.idx)
                picked = req.idx == self.choose(req.doc)
            else:  # the books task: one request, the target word
                picked = continuation == " " + self.word(req.doc)
            out.append((0.0 if picked else -5.0, picked))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        return [-1.0 for _ in requests]

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            self.prompts.append(req.args[0])
            if "choices" in req.doc:
                i = self.choose(req.doc)
                out.append(f" {LETTERS[i]}" if self.by == "letter" else f" {req.doc['choices'][i]}")
            else:
                out.append(f" {self.word(req.doc)}, and so on")
        return out
