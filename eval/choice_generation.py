"""Multiple-choice tasks scored by generation: the lettered variant of any lm-eval task.

lm-eval scores a ``multiple_choice`` task by log-likelihood: the choice whose continuation the
model finds likeliest is its answer. A model can rank continuations well and still not answer the
question when asked (a 2026 study of distilled models found log-likelihood scoring hid a
20.8-point gap that generation scoring exposed). :func:`generation_variant` builds, from a loaded
multiple-choice task, a ``generate_until`` task over the same documents and few-shot examples:

    <the task's prompt, its trailing "Answer:" removed>
    A. <choice 0>
    B. <choice 1>
    ...
    Answer:

(prompts that already list their choices as ``A``, ``B``, ... with those letters as the
choices, like MMLU's, are kept as they are). Few-shot examples are shown in the same form with
their gold letter. The model continues greedily (at most ``max_new_tokens`` tokens, stopping at
a newline) and an item is right when the answer names the gold choice: by its letter (``B``,
``B.``, ``(B)``, ``B) ...``) or by the choice's exact text (case and punctuation aside).
Metrics: ``exact_match`` (share right) and ``valid`` (share of answers that name some choice).

The variant is named ``<task>:gen``; :func:`group_scores` gives groups of multiple-choice
tasks (MMLU) their generation score, the mean over their subtasks weighted by size as lm-eval
weights MMLU.
"""
from __future__ import annotations

import re
import string
from typing import Any

SUFFIX = ":gen"
SCORES = ("loglik", "generation", "both")  # how the harness scores multiple-choice tasks
LETTERS = string.ascii_uppercase
DEFAULT_MAX_NEW_TOKENS = 16
_ANSWER_TAIL = re.compile(r"\s*Answer:\s*$")
_LETTER = re.compile(r"^\(?([A-Z])(?:[.):,]|\s*$)")


def variant_name(task: str) -> str:
    """``arc_easy`` -> ``arc_easy:gen``."""
    return task + SUFFIX


def lettered_prompt(text: str, choices: list[str]) -> str:
    """The question (its trailing ``Answer:`` dropped) with the choices listed as ``A. ...``,
    then ``Answer:``; a prompt whose choices are already the letters ``A``, ``B``, ... is kept."""
    if len(choices) > len(LETTERS):
        raise ValueError(f"{len(choices)} choices: at most {len(LETTERS)} can be lettered")
    if [c.strip() for c in choices] == list(LETTERS[: len(choices)]):
        return text
    stem = _ANSWER_TAIL.sub("", text).rstrip()
    lines = [stem] if stem else []
    lines += [f"{LETTERS[i]}. {choice.strip()}" for i, choice in enumerate(choices)]
    lines.append("Answer:")
    return "\n".join(lines)


def _normalise(text: str) -> str:
    return " ".join(text.lower().translate(str.maketrans("", "", string.punctuation)).split())


def parse_answer(answer: str, choices: list[str]) -> int | None:
    """The choice a generated answer names: its letter first, else a choice's exact text; None
    when it names none (or an ambiguous text)."""
    first = answer.strip().split("\n")[0].strip()
    m = _LETTER.match(first)
    if m and LETTERS.index(m.group(1)) < len(choices):
        return LETTERS.index(m.group(1))
    said = _normalise(first)
    hits = [i for i, c in enumerate(choices) if said and _normalise(c) == said]
    return hits[0] if len(hits) == 1 else None


class _Formatter:
    """The variant's doc_to_text / doc_to_target / process_results, over the source task."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def choices_and_gold(self, doc: dict) -> tuple[str, list[str], int]:
        """(question text, choices, gold index) of a source document."""
        src = self.source
        text, choices, target = src.doc_to_text(doc), list(src.doc_to_choice(doc)), src.doc_to_target(doc)
        if isinstance(text, int):  # several contexts, one continuation (Winogrande)
            delim = src.config.target_delimiter
            return "", [f"{c}{delim}{target}".strip() for c in choices], text
        if isinstance(target, list):  # several gold answers: the first counts
            target = target[0]
        gold = target if isinstance(target, int) else choices.index(target)
        return text, choices, gold

    def text(self, doc: dict) -> str:
        question, choices, _ = self.choices_and_gold(doc)
        return lettered_prompt(question, choices)

    def target(self, doc: dict) -> str:
        return LETTERS[self.choices_and_gold(doc)[2]]

    def score(self, doc: dict, results: list[str]) -> dict[str, float]:
        _, choices, gold = self.choices_and_gold(doc)
        picked = parse_answer(results[0], choices)
        return {"exact_match": float(picked == gold), "valid": float(picked is not None)}


def generation_variant(source: Any, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> Any:
    """A ``generate_until`` task over ``source``'s documents (a loaded lm-eval multiple-choice
    ``ConfigurableTask``), sharing its dataset (nothing is downloaded again)."""
    from dataclasses import fields

    from lm_eval.api.task import ConfigurableTask

    if source.OUTPUT_TYPE != "multiple_choice":
        raise ValueError(f"{source.config.task} is {source.OUTPUT_TYPE}, not multiple_choice")
    fmt = _Formatter(source)
    cfg = {f.name: getattr(source.config, f.name) for f in fields(source.config)}
    fs = source.config.fewshot_config
    cfg.update(
        task=variant_name(source.config.task), task_alias=None, tag=None, use_prompt=None,
        output_type="generate_until", doc_to_text=fmt.text, doc_to_target=fmt.target,
        doc_to_choice=None, target_delimiter=" ", gen_prefix=None, filter_list=None,
        process_results=fmt.score,
        metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("exact_match", "valid")],
        generation_kwargs={"until": ["\n"], "max_gen_toks": max_new_tokens, "do_sample": False},
        fewshot_config=None if fs is None else {
            "sampler": fs.sampler, "split": fs.split, "process_docs": fs.process_docs,
            "fewshot_indices": fs.fewshot_indices, "samples": fs.samples,
        },
    )

    class _Variant(ConfigurableTask):
        def download(self, dataset_kwargs: dict | None = None, **kwargs: Any) -> None:
            self.dataset = source.dataset

    return _Variant(config=cfg)


def group_scores(results: dict[str, dict], group_subtasks: dict[str, list[str]],
                 samples: dict[str, dict]) -> dict[str, dict]:
    """Generation scores of groups (``mmlu:gen``): each group's variant metrics averaged over its
    leaf tasks' variants, weighted by their sample counts; only groups whose every leaf has one.

    results / samples: lm-eval's ``results`` and ``n-samples`` (variants included);
    group_subtasks: lm-eval's group -> children map of the source groups.
    """

    def leaves(name: str) -> list[str]:
        if name in group_subtasks:
            return [leaf for child in group_subtasks[name] for leaf in leaves(child)]
        return [name]

    out: dict[str, dict] = {}
    for group in group_subtasks:
        names = [variant_name(leaf) for leaf in leaves(group)]
        if not names or any(n not in results for n in names):
            continue
        weights = [float((samples.get(n) or {}).get("effective", 1)) for n in names]
        total = sum(weights) or 1.0
        entry: dict[str, Any] = {"alias": variant_name(group)}
        for metric in ("exact_match,none", "valid,none"):
            entry[metric] = sum(w * results[n][metric] for w, n in zip(weights, names)) / total
        out[variant_name(group)] = entry
    return out
