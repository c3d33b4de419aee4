"""Needle in a haystack over real essays (``retrofit eval niah``), Greg Kamradt's test, offline.

A needle sentence is hidden in Paul Graham's essays (:mod:`retrofit.eval.essays`; another corpus
with ``haystack``) at a relative depth, and the model is asked the question it answers. The prompt
is the ``needlehaystack`` package's plain-text prompt, built in tokens so it is exactly L tokens::

    [BOS] You are a helpful AI bot that answers questions for a user. Keep your response short and direct

    Human: <context>
    {essays[:k]} {NEEDLE} {essays[k:]}
    </context>

    {QUESTION} Don't give information outside the document or repeat your findings

    Assistant: Here is the most relevant sentence in the context:

With a chat template the first line is the system turn, ``<context> ... findings`` the user turn
and ``Here is the most relevant sentence in the context:`` opens the assistant's. As in the
package, ``k`` is ``depth`` of the way into the haystack, moved back to the end of the sentence
before it (depth 1: right before ``</context>``). The model answers greedily through
``model.generate``; a trial scores the fraction of the ``answers`` strings found in the answer
(case-insensitive; Kamradt's GPT-4 judge is not offline), averaged per (length, depth) cell, and
drawn as the field draws it: depth (y) x context length (x), red -> yellow -> green.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from retrofit.errors import DataError
from retrofit.eval import essays, loading, prompting, report
from retrofit.eval.generation import check_prefill_chunk, copied_note, mean_or_none, recall, run_prompts, setup
from retrofit.eval.options import run_options
from retrofit.eval.passkey import haystack_tokens
from retrofit.eval.windows import encode
from retrofit.fs.atomic import save_figure_atomic

SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
ANSWERS = ("sandwich", "Dolores Park")
ANSWER_PREFIX = "Here is the most relevant sentence in the context:"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_DEPTHS = tuple(i / 10 for i in range(11))
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_PREFILL_CHUNK = 4096
_STRIDE = 7919  # haystack offset between trials (a prime, as in passkey)


def _parts(tokenizer: Any, frame: prompting.Frame, question: str) -> tuple[list[int], list[int]]:
    ask = f"{question} Don't give information outside the document or repeat your findings"
    if frame.chat:
        prefix = list(frame.head) + encode(tokenizer, "<context>\n")
        suffix = (encode(tokenizer, f"\n</context>\n\n{ask}") + list(frame.tail)
                  + prompting.answer_prefix_ids(tokenizer, frame, ANSWER_PREFIX))
    else:
        prefix = list(frame.head) + encode(tokenizer, f"{SYSTEM}\n\nHuman: <context>\n")
        suffix = encode(tokenizer, f"\n</context>\n\n{ask}\n\nAssistant: {ANSWER_PREFIX}")
    return prefix, suffix


def _sentence_start(tokenizer: Any, ids: list[int], k: int) -> int:
    """The largest ``j <= k`` such that ``ids[j - 1]`` ends a sentence (its text ends with '.'), or 0."""
    ends: dict[int, bool] = {}
    while k > 0:
        t = ids[k - 1]
        if t not in ends:
            ends[t] = tokenizer.decode([t]).rstrip().endswith(".")
        if ends[t]:
            return k
        k -= 1
    return 0


def build_prompt(tokenizer: Any, filler: list[int], length: int, depth: float, *, frame: prompting.Frame,
                 needle: str = NEEDLE, question: str = QUESTION) -> tuple[list[int], int, int]:
    """Token ids of a NIAH prompt of exactly ``length`` tokens, the needle's start index and its
    relative position in the haystack (after moving back to a sentence end)."""
    if not 0.0 <= depth <= 1.0:
        raise DataError(f"depth {depth} must be in [0, 1]")
    prefix, suffix = _parts(tokenizer, frame, question)
    needle_ids = encode(tokenizer, needle)
    budget = length - len(prefix) - len(suffix) - len(needle_ids)
    if budget < 0:
        raise DataError(f"NIAH length {length} is too short: the prompt around the haystack takes "
                        f"{length - budget} tokens")
    if len(filler) < budget:
        raise DataError(f"haystack has {len(filler)} tokens, {budget} needed")
    k = budget if depth >= 1.0 else _sentence_start(tokenizer, filler, int(budget * depth))
    ids = prefix + filler[:k] + needle_ids + filler[k:budget] + suffix
    assert len(ids) == length
    return ids, len(prefix) + k, (k / budget if budget else 1.0)


def run_niah(
    model: Any,
    *,
    lengths: list[int] | tuple[int, ...] = DEFAULT_LENGTHS,
    depths: list[float] | tuple[float, ...] = DEFAULT_DEPTHS,
    trials: int = 1,
    haystack: str = essays.ESSAYS,
    needle: str = NEEDLE,
    question: str = QUESTION,
    answers: list[str] | tuple[str, ...] | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    chat_template: str = "auto",
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    seed: int = 0,
    bos: str = "auto",
    zero_shot: list[str] | tuple[str, ...] = (),
    **options: Any,
) -> dict:
    """NIAH scores over a (length x depth) grid for ``model`` (and ``baseline``), same prompts.

    needle / question: the sentence hidden and the question asked; answers: the strings a correct
    answer contains (required with a custom needle; default: ``sandwich``, ``Dolores Park``).
    trials: prompts per cell, each from another stretch of the haystack. seed: unused by the
    prompts (they are deterministic) and kept for the common interface.
    zero_shot: variant specs scored beside the two (:mod:`retrofit.eval.variants`), e.g. ``yarn:4``, ``closed``.
    options: tokenizer, baseline, baseline_tokenizer, device, dtype, rope_cap, out, progress,
        command (:class:`retrofit.eval.options.RunOptions`).
    Returns the results dict; with ``out``, writes results.json, table.md, niah.png.
    """
    opts = run_options("run_niah", options)
    if answers is None:
        if needle != NEEDLE:
            raise DataError("a custom needle needs its answers (the strings a correct answer contains)")
        answers = ANSWERS
    answers = [a for a in answers if a.strip()]
    if not answers:
        raise DataError("answers must hold at least one non-empty string")
    lengths = sorted(set(int(x) for x in lengths))
    depths = [float(d) for d in depths]
    if trials < 1:
        raise DataError("trials must be at least 1")
    if max_new_tokens < 1:
        raise DataError("max_new_tokens must be at least 1")
    check_prefill_chunk(prefill_chunk)
    hay = essays.resolve_haystack(haystack)
    run = setup(model, options=opts, zero_shot=zero_shot, bos=bos, chat_template=chat_template, system=SYSTEM)
    roles, tok, use_bos, chat, frame = run.roles, run.tokenizer, run.use_bos, run.chat, run.frame

    stream = haystack_tokens(tok, hay.source, need=max(lengths) + _STRIDE * trials)
    prompts = []
    for L in lengths:
        for d in depths:
            for t in range(trials):
                off = (t * _STRIDE) % len(stream)
                filler = (stream[off:] + stream[:off])[:L]
                ids, at, placed = build_prompt(tok, filler, L, d, frame=frame, needle=needle, question=question)
                prompts.append({"length": L, "depth": d, "trial": t, "ids": ids, "needle_at": at,
                                "placed_depth": round(placed, 4)})

    records, seconds, attention = run_prompts(
        roles, prompts, score=lambda p, text: recall(text, answers), max_new_tokens=lambda p, _t: max_new_tokens,
        prefill_chunk=prefill_chunk, desc="niah", progress=opts.progress,
        keep=("depth", "trial", "needle_at", "placed_depth"),
    )
    results: dict[str, dict] = {}
    for role, recs in records.items():
        grid = {str(L): {f"{d:g}": mean_or_none([r["score"] for r in recs if r["length"] == L and r["depth"] == d])
                         for d in depths} for L in lengths}
        results[role] = {"score": grid, "mean_score": mean_or_none([r["score"] for r in recs]),
                         "trials": recs, "seconds_per_length": seconds[role]}

    res = {
        "kind": "niah",
        "models": {role: loading.model_info(mdl, label) for role, (mdl, _, label) in roles.items()},
        "settings": {
            "lengths": lengths, "depths": depths, "trials": trials, "haystack": hay.describe(),
            "needle": needle, "question": question, "answers": list(answers), "max_new_tokens": max_new_tokens,
            "chat_template": chat, "bos_used": use_bos, "seed": seed, "device": opts.device, "dtype": opts.dtype,
            "prefill_chunk": prefill_chunk or None, "decoding": "greedy, model.generate",
            "scoring": "recall of the answer strings in the generated text", "attention": attention,
        },
        "results": results,
    }
    description = (
        f"Needle in a haystack (score %, recall of {', '.join(repr(a) for a in answers)} in the greedy answer, "
        f"{trials} trial(s) per cell); rows: needle depth (0 = start of the haystack, 1 = end); columns: "
        f"prompt length in tokens. Haystack: {hay.name}"
        f"{' (fallback: the essays are not installed)' if hay.fallback else ''}. "
        f"Chat template: {'on' if chat else 'off'}."
    ) + copied_note(records)
    return opts.finish(res, description=description, table=table_markdown, plot=plot_heatmap, image="niah.png")


def table_markdown(res: dict) -> str:
    """One block per model: rows depths (+ mean), columns lengths; scores in percent."""
    lengths, depths = res["settings"]["lengths"], res["settings"]["depths"]
    header = ["Model", "Depth"] + [report.fmt_length(L) for L in lengths]
    rows = []
    for role in res["results"]:  # in table order (baseline first)
        label = res["models"][role]["label"]
        grid = res["results"][role]["score"]
        for i, d in enumerate(depths):
            v = [grid[str(L)][f"{d:g}"] for L in lengths]
            rows.append([label if i == 0 else "", f"{d:g}", *["OOM" if x is None else f"{100 * x:.0f}" for x in v]])
        mean = [mean_or_none([grid[str(L)][f"{d:g}"] for d in depths]) for L in lengths]
        rows.append(["", "mean", *["OOM" if x is None else f"{100 * x:.0f}" for x in mean]])
    return report.markdown_table(header, rows, align=["l", "l"] + ["r"] * len(lengths))


def plot_heatmap(res: dict, path: str | Path) -> Path:
    """Kamradt's heat map: depth percent (y, 0 at the top) x context length (x), score colours
    red (0) -> yellow -> green (100), one panel per model."""
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    plt = report.pyplot()
    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    lengths, depths = res["settings"]["lengths"], res["settings"]["depths"]
    roles = list(res["results"])  # table order (baseline first)
    width = len(roles) * (1.8 + 0.7 * len(lengths)) + 1.2
    fig, axes = plt.subplots(1, len(roles), figsize=(width, 0.38 * len(depths) + 2.2), squeeze=False,
                             constrained_layout=True)
    im = None
    for k, (ax, role) in enumerate(zip(axes[0], roles)):
        grid = res["results"][role]["score"]
        data = np.array([[np.nan if grid[str(L)][f"{d:g}"] is None else 100 * grid[str(L)][f"{d:g}"]
                          for L in lengths] for d in depths], dtype=float)
        im = ax.imshow(data, vmin=0.0, vmax=100.0, cmap=cmap, aspect="auto")
        ax.set_xticks(range(len(lengths)), [report.fmt_length(L) for L in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{100 * d:g}" for d in depths])
        ax.set_xticks(np.arange(-0.5, len(lengths)), minor=True)
        ax.set_yticks(np.arange(-0.5, len(depths)), minor=True)
        ax.grid(which="minor", color="grey", linewidth=0.5)
        ax.tick_params(which="minor", length=0)
        ax.set_xlabel("Token Limit")
        if k == 0:
            ax.set_ylabel("Depth Percent")
        mean = res["results"][role]["mean_score"]
        ax.set_title(f"{res['models'][role]['label']}\n(mean {'-' if mean is None else f'{100 * mean:.0f}'})",
                     fontsize=10)
        for i, j in zip(*np.where(np.isnan(data))):
            ax.text(j, i, "OOM", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="Score")
    fig.suptitle('Fact Retrieval Across Context Lengths ("Needle In A HayStack")')
    path = save_figure_atomic(fig, path)
    plt.close(fig)
    return path
