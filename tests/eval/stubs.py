"""Stand-in language models whose answers are known, for scoring tests of generation-scored tasks.

:class:`ScriptedLM` is an ``nn.Module`` with a ``generate`` that continues a prompt with the
tokens its script returns (truncated to ``max_new_tokens``), so the evaluators' real path
(``generation.generate_answer`` -> ``model.generate`` -> decode -> score) runs unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from retrofit.eval.windows import encode


class ScriptedLM(nn.Module):
    """``script(prompt_ids) -> new token ids``; ``name`` labels it in tables."""

    def __init__(self, script: Callable[[list[int]], list[int]], name: str = "scripted"):
        super().__init__()
        self.script = script
        self.anchor = nn.Parameter(torch.zeros(1))  # for device / dtype / parameter counts
        self.config = SimpleNamespace(_name_or_path=name, model_type=None)
        self.prompts: list[list[int]] = []

    def forward(self, *args, **kwargs):  # pragma: no cover - the evaluators only generate
        raise RuntimeError("ScriptedLM only generates")

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """input_ids [1, T] -> [1, T + n], n <= max_new_tokens."""
        assert input_ids.shape[0] == 1 and kwargs.get("do_sample") is False
        ids = input_ids[0].tolist()
        self.prompts.append(ids)
        new = list(self.script(ids))[:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype)], dim=1)


def says(tokenizer, text: str, name: str = "says") -> ScriptedLM:
    """Always answers ``text``."""
    ids = encode(tokenizer, text)
    return ScriptedLM(lambda _prompt: ids, name=name)


def copier(n: int = 3, name: str = "copier") -> ScriptedLM:
    """Induction by lookup: repeatedly find the latest earlier occurrence of the last ``n`` tokens
    and emit the token that followed it (how a model copies a key it has read)."""

    def script(prompt: list[int]) -> list[int]:
        seq = list(prompt)
        out: list[int] = []
        for _ in range(24):
            tail = seq[-n:]
            nxt = None
            for j in range(len(seq) - n - 1, -1, -1):
                if seq[j : j + n] == tail:
                    nxt = seq[j + n]
                    break
            if nxt is None:
                break
            out.append(nxt)
            seq.append(nxt)
        return out

    return ScriptedLM(script, name=name)


def oracle(answers: dict[tuple[int, ...], str], tokenizer, name: str = "oracle") -> ScriptedLM:
    """Answers each known prompt with its text (by prompt ids); unknown prompts get nothing."""
    table = {k: encode(tokenizer, " " + v) for k, v in answers.items()}
    return ScriptedLM(lambda prompt: table.get(tuple(prompt), []), name=name)
