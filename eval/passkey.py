"""Passkey retrieval: a number hidden in long haystack text at a chosen depth; can the model say it?

Prompt (built in tokens, so its length is exactly L; BOS first when the model uses BOS)::

    [BOS] INTRO  filler[:k]  NEEDLE  filler[k:]  QUESTION

    INTRO    = "There is an important piece of information hidden inside a lot of irrelevant
                text. Find it and memorize it. I will quiz you about it later.\\n\\n"
    NEEDLE   = " The pass key is 48213. Remember it. 48213 is the pass key. "
    QUESTION = "\\n\\nWhat is the pass key? The pass key is"

The filler is real book text (pg-books by default; a different stretch per trial), or with
``haystack="noise"`` the classic filler of Mohtashami & Jaggi (2023), also RULER's noise haystack,
``"The grass is green. The sky is blue. ..."`` repeated (every trial alike but for its key), and
``k = round(depth * filler_length)``: depth 0 puts the needle right after the intro, depth 1
right before the question. The model continues greedily with ``model.generate`` (for a converted
model: its constant-memory decoding path); a trial counts as correct when the first number in
the continuation equals the key exactly. Accuracy per (length, depth) is averaged over trials.
A prompt longer than ``prefill_chunk`` tokens is first run through the model's cache in chunks
(a 64K prompt of Gemma 3 270M in one prefill peaked at 18 GB of RSS), and ``generate`` continues
from that cache. With a chat template (``chat_template``: auto = when the tokenizer has one), the
intro, haystack and question form the user turn and ``The pass key is`` opens the assistant's
(:mod:`retrofit.eval.prompting`); the prompt is still exactly L tokens.
"""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from retrofit.errors import DataError
from retrofit.eval import corpora, loading, prompting, report
from retrofit.eval.ruler_tasks import REPEAT_NOISE
from retrofit.eval.generation import check_prefill_chunk, copied_note, run_prompts, setup
from retrofit.eval.generation import generate_answer, prefill  # noqa: F401  (their former home)
from retrofit.eval.options import run_options
from retrofit.eval.windows import encode, encode_prefix
from retrofit.fs.atomic import save_figure_atomic

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it later.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
QUESTION_ASK, ANSWER_PREFIX = "\n\nWhat is the pass key?", "The pass key is"  # split around a chat turn's end
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_PREFILL_CHUNK = 4096  # longer prompts reach generate through a cache filled in chunks
_NUMBER = re.compile(r"\d+")


NOISE_HAYSTACK = "noise"  # not a corpus: the repeated sentences of the original passkey test


def haystack_tokens(tokenizer, corpus: str = "pg-books", *, need: int, max_docs: int | None = None) -> list[int]:
    """Token stream of the haystack corpus (documents joined by blank lines), at least ``need`` long
    if the corpus allows (it is repeated otherwise); ``"noise"``: :data:`REPEAT_NOISE` repeated."""
    if corpus == NOISE_HAYSTACK:
        unit = encode(tokenizer, " " + REPEAT_NOISE)
        return unit * (need // len(unit) + 1)
    spec = corpora.resolve_corpus(corpus)
    sep = encode(tokenizer, "\n\n")
    stream: list[int] = []
    for doc in corpora.iter_documents(spec, max_docs=max_docs):
        stream.extend(encode_prefix(tokenizer, doc.text, need - len(stream)))
        stream.extend(sep)
        if len(stream) >= need:
            break
    if not stream:
        raise DataError(f"haystack corpus {corpus!r} has no text")
    while len(stream) < need:
        stream = stream + stream
    return stream


def build_prompt(
    tokenizer,
    filler: list[int],
    length: int,
    depth: float,
    key: str,
    *,
    bos_id: int | None,
    frame: prompting.Frame | None = None,
) -> tuple[list[int], int]:
    """Token ids of a passkey prompt of exactly ``length`` tokens, and the needle's start index.

    frame: a chat frame (:func:`retrofit.eval.prompting.build_frame`): the question ends the user
    turn and ``The pass key is`` opens the assistant's; None or a plain frame: the prompt above."""
    if not 0.0 <= depth <= 1.0:
        raise DataError(f"depth {depth} must be in [0, 1]")
    prefix, intro, needle, question = _instructions(tokenizer, key, bos_id=bos_id, frame=frame)
    budget = length - len(prefix) - len(intro) - len(needle) - len(question)
    _check_budget(length, budget)
    if len(filler) < budget:
        raise DataError(f"haystack has {len(filler)} tokens, {budget} needed")
    k = int(round(depth * budget))
    ids = prefix + intro + filler[:k] + needle + filler[k:budget] + question
    assert len(ids) == length
    return ids, len(prefix) + len(intro) + k


def _instructions(tokenizer, key: str, *, bos_id: int | None, frame: prompting.Frame | None):
    """The token ids around the filler: ``(prefix, intro, needle, question)``."""
    intro = encode(tokenizer, INTRO)
    needle = encode(tokenizer, NEEDLE.format(key=key))
    if frame is not None and frame.chat:
        prefix = list(frame.head)
        answer = prompting.answer_prefix_ids(tokenizer, frame, ANSWER_PREFIX)
        question = encode(tokenizer, QUESTION_ASK) + frame.tail + answer
    else:
        prefix = [bos_id] if bos_id is not None else []
        question = encode(tokenizer, QUESTION)
    return prefix, intro, needle, question


def _check_budget(length: int, budget: int) -> None:
    if budget < 0:
        raise DataError(
            f"passkey length {length} is too short: the instructions alone take {length - budget} tokens"
        )


def _grid_keys(lengths: list[int], depths: list[float], trials: int, key_digits: int, seed: int):
    """``(length, key)`` of each prompt of :func:`prompt_grid`, in its order (the same random keys)."""
    rng = random.Random(seed)
    for L in lengths:
        for _ in depths:
            for _ in range(trials):
                yield L, str(rng.randrange(10 ** (key_digits - 1), 10**key_digits))


def check_lengths(
    model: Any,
    *,
    tokenizer: Any,
    lengths: list[int] | tuple[int, ...] = DEFAULT_LENGTHS,
    depths: list[float] | tuple[float, ...] = DEFAULT_DEPTHS,
    trials: int = 5,
    key_digits: int = 5,
    seed: int = 0,
    bos: str = "auto",
    chat_template: str = "auto",
    **_: Any,
) -> None:
    """The ``DataError`` :func:`run_passkey` raises for a length its instructions do not fit, from the loaded
    model and its tokenizer alone (no haystack, no generation): ``eval all`` calls it before its first part runs,
    so a too-short ``--passkey-lengths`` is not found after the perplexity part's minutes."""
    lengths = sorted(set(int(x) for x in lengths))
    use_bos = loading.needs_bos(model, tokenizer, bos)
    chat = prompting.use_chat_template(tokenizer, chat_template)
    bos_id = tokenizer.bos_token_id if use_bos else None
    frame = prompting.build_frame(tokenizer, chat=chat, bos_id=bos_id, system=None)
    fixed = None
    needles: dict[str, int] = {}
    for L, key in _grid_keys(lengths, list(depths), trials, key_digits, seed):
        if key not in needles:
            prefix, intro, needle, question = _instructions(tokenizer, key, bos_id=bos_id, frame=frame)
            fixed = len(prefix) + len(intro) + len(question) if fixed is None else fixed
            needles[key] = len(needle)
        _check_budget(L, L - fixed - needles[key])


def prompt_grid(
    tokenizer,
    lengths: list[int],
    depths: list[float],
    *,
    trials: int,
    haystack: str = "pg-books",
    key_digits: int = 5,
    seed: int = 0,
    bos_id: int | None = None,
    frame: prompting.Frame | None = None,
) -> list[dict]:
    """The prompts of a (length x depth x trial) grid, in that order: ``{"length", "depth", "trial",
    "key", "needle_at", "ids"}`` each. A function of its arguments only, so every model (and every
    script that scores the evaluator's prompts another way) sees the same keys and filler."""
    stride = 7919  # filler offset between trials (a prime: stretches do not line up with books)
    stream = haystack_tokens(tokenizer, haystack, need=max(lengths) + stride * trials)
    rng = random.Random(seed)
    prompts: list[dict] = []
    for L in lengths:
        for d in depths:
            for t in range(trials):
                key = str(rng.randrange(10 ** (key_digits - 1), 10**key_digits))
                off = (t * stride) % len(stream)
                filler = (stream[off:] + stream[:off])[:L]
                ids, pos = build_prompt(tokenizer, filler, L, d, key, bos_id=bos_id, frame=frame)
                prompts.append({"length": L, "depth": d, "trial": t, "key": key, "needle_at": pos, "ids": ids})
    return prompts


def parse_answer(text: str) -> str | None:
    """The first run of digits in the model's continuation, or None."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def run_passkey(
    model: Any,
    *,
    lengths: list[int] | tuple[int, ...] = DEFAULT_LENGTHS,
    depths: list[float] | tuple[float, ...] = DEFAULT_DEPTHS,
    trials: int = 5,
    haystack: str = "pg-books",
    key_digits: int = 5,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    chat_template: str = "auto",
    seed: int = 0,
    bos: str = "auto",
    zero_shot: list[str] | tuple[str, ...] = (),
    **options: Any,
) -> dict:
    """Passkey accuracy over a (length x depth) grid for ``model`` (and ``baseline``).

    trials: prompts per cell, each with its own random ``key_digits``-digit key and filler
        stretch (the same prompts for every model). haystack: a corpus name or path.
    prefill_chunk: a prompt longer than this is run through the model's cache in chunks of this many
        tokens before ``generate`` continues from it (bounded memory; None or 0: one prefill).
    chat_template: ``auto`` (the tokenizer's chat template when it has one), ``on`` or ``off``.
    zero_shot: variant specs scored beside the two (:mod:`retrofit.eval.variants`), e.g. ``yarn:4``,
        ``cap:8191``, ``closed``.
    options: tokenizer, baseline, baseline_tokenizer, device, dtype, rope_cap, out, progress,
        command (:class:`retrofit.eval.options.RunOptions`).
    Returns the results dict; with ``out``, writes results.json, table.md, passkey.png.
    """
    opts = run_options("run_passkey", options)
    lengths = sorted(set(int(x) for x in lengths))
    depths = [float(d) for d in depths]
    if trials < 1:
        raise DataError("trials must be at least 1")
    check_prefill_chunk(prefill_chunk)
    run = setup(model, options=opts, zero_shot=zero_shot, bos=bos, chat_template=chat_template)
    roles, tok, use_bos, chat, frame = run.roles, run.tokenizer, run.use_bos, run.chat, run.frame
    bos_id = tok.bos_token_id if use_bos else None

    prompts = prompt_grid(tok, lengths, depths, trials=trials, haystack=haystack, key_digits=key_digits,
                          seed=seed, bos_id=bos_id, frame=frame)

    records, seconds, attention = run_prompts(
        roles, prompts, score=lambda p, text: float(parse_answer(text) == p["key"]),
        max_new_tokens=lambda p, mtok: len(encode(mtok, " " + p["key"])) + 2, prefill_chunk=prefill_chunk,
        desc="passkey", progress=opts.progress, keep=("depth", "trial", "key", "needle_at"),
    )
    results: dict[str, dict] = {}
    for role, recs in records.items():
        trials_out = [_trial(r) for r in recs]
        grid: dict[str, dict[str, float | None]] = {}
        for L in lengths:
            grid[str(L)] = {}
            for d in depths:
                cell = [r for r in trials_out if r["length"] == L and r["depth"] == d]
                done = [r["correct"] for r in cell if r["correct"] is not None]
                grid[str(L)][f"{d:g}"] = (sum(done) / len(done)) if done else None
        scored = [r["correct"] for r in trials_out if r["correct"] is not None]
        results[role] = {
            "accuracy": grid,
            "mean_accuracy": (sum(scored) / len(scored)) if scored else None,
            "trials": trials_out,
            "seconds_per_length": seconds[role],
        }

    res = {
        "kind": "passkey",
        "models": {role: loading.model_info(mdl, label) for role, (mdl, _, label) in roles.items()},
        "settings": {
            "lengths": lengths, "depths": depths, "trials": trials, "haystack": haystack,
            "key_digits": key_digits, "seed": seed, "bos_used": use_bos, "device": opts.device, "dtype": opts.dtype,
            "prefill_chunk": prefill_chunk or None, "chat_template": chat,
            "decoding": "greedy, model.generate", "attention": attention,
        },
        "results": results,
    }
    description = (
        f"Passkey retrieval accuracy (%, exact match of a {key_digits}-digit key, {trials} trial(s) "
        f"per cell, greedy decoding); rows: needle depth (0 = start of the haystack, 1 = end); "
        f"columns: prompt length in tokens. Haystack: {haystack}. "
        f"Chat template: {'on' if chat else 'off'}."
    ) + copied_note(records)
    return opts.finish(res, description=description, table=table_markdown, plot=plot_heatmap, image="passkey.png")


def _trial(record: dict) -> dict:
    """A :func:`run_prompts` record as a passkey trial: the number the model wrote and whether it is the key."""
    out = {k: v for k, v in record.items() if k not in ("output", "score")}
    text = record.get("output")
    out.update(answer=None if text is None else parse_answer(text), output=None if text is None else text[:80],
               correct=None if record.get("score") is None else record["score"] == 1.0)
    return out


def table_markdown(res: dict) -> str:
    """One block per model: rows depths (+ mean), columns lengths; accuracy in percent."""
    lengths = res["settings"]["lengths"]
    depths = res["settings"]["depths"]
    roles = [r for r in report.role_order(res["models"]) if r in res["results"]]
    header = ["Model", "Depth"] + [report.fmt_length(L) for L in lengths]
    rows = []
    for role in roles:
        label = res["models"][role]["label"]
        grid = res["results"][role]["accuracy"]
        trials = res["results"][role]["trials"]

        def copied(L: int, d: float | None = None) -> bool:
            cell = [r for r in trials if r["length"] == L and (d is None or r["depth"] == d)]
            return bool(cell) and all(r.get("same_as") for r in cell)

        for i, d in enumerate(depths):
            row = [label if i == 0 else "", f"{d:g}"]
            for L in lengths:
                v = grid[str(L)][f"{d:g}"]
                row.append("= base" if copied(L, d) else "OOM" if v is None else f"{100 * v:.0f}")
            rows.append(row)
        mean = []
        for L in lengths:
            vals = [grid[str(L)][f"{d:g}"] for d in depths if grid[str(L)][f"{d:g}"] is not None]
            mean.append("= base" if copied(L) else f"{100 * sum(vals) / len(vals):.0f}" if vals else "OOM")
        rows.append(["", "mean", *mean])
    return report.markdown_table(header, rows, align=["l", "l"] + ["r"] * len(lengths))


def plot_heatmap(res: dict, path: str | Path) -> Path:
    """Accuracy heat map (depth x length), one panel per model."""
    import numpy as np

    plt = report.pyplot()
    lengths = res["settings"]["lengths"]
    depths = res["settings"]["depths"]
    roles = [r for r in report.role_order(res["models"]) if r in res["results"]]
    width = len(roles) * (1.6 + 0.75 * len(lengths)) + 1.2
    fig, axes = plt.subplots(1, len(roles), figsize=(width, 0.45 * len(depths) + 2.0), squeeze=False,
                             constrained_layout=True)
    for k, (ax, role) in enumerate(zip(axes[0], roles)):
        grid = res["results"][role]["accuracy"]
        data = np.array([[np.nan if grid[str(L)][f"{d:g}"] is None else grid[str(L)][f"{d:g}"]
                          for L in lengths] for d in depths], dtype=float)
        im = ax.imshow(data, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [report.fmt_length(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        if k == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(res["models"][role]["label"], fontsize=10)
        report.label_cells(ax, data)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle("Passkey retrieval")
    path = save_figure_atomic(fig, path)
    plt.close(fig)
    return path
