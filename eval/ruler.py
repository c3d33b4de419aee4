"""RULER-style retrieval and aggregation (``retrofit eval ruler``), offline and generation-scored.

Prompts come from :mod:`retrofit.eval.ruler_tasks` (lm-eval's ``ruler`` prompts, generated here
in tokens: exact lengths, any tokenizer, seeded, no download). Each model continues each prompt
greedily through ``model.generate`` (at most the task's RULER budget of new tokens, or
``max_new_tokens``), prompts longer than ``prefill_chunk`` reaching ``generate`` through a cache
filled in chunks. A sample scores RULER's ``string_match_all``: the fraction of its expected
strings found (case-insensitive) in the answer; a task's score at a length is the mean over its
samples, in percent, and ``average`` is the mean over tasks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from retrofit.errors import DataError
from retrofit.eval import essays, loading, prompting, report
from retrofit.eval.generation import check_prefill_chunk, copied_note, mean_or_none, recall, run_prompts, setup
from retrofit.eval.options import run_options
from retrofit.eval.ruler_tasks import TASKS, EssayUnits, get_task, make_sample
from retrofit.fs.atomic import save_figure_atomic

DEFAULT_TASKS = tuple(TASKS)
DEFAULT_LENGTHS = (4096, 8192, 16384)
DEFAULT_PREFILL_CHUNK = 4096


def build_prompts(tokenizer: Any, *, tasks: list[str], lengths: list[int], samples: int, frame: prompting.Frame,
                  seed: int = 0, max_new_tokens: int | None = None,
                  haystack: essays.Haystack | None = None) -> tuple[list[dict], EssayUnits | None]:
    """Every prompt of a run, in (task, length, index) order, as dicts for
    :func:`retrofit.eval.generation.run_prompts` (``ids``, ``length``, ``task``, ``index``,
    ``outputs``, ``max_new_tokens``); and the essay haystack they read (None if none did)."""
    needs_essay = any(get_task(t).haystack == "essay" for t in tasks)
    units = EssayUnits(tokenizer, haystack or essays.resolve_haystack()) if needs_essay else None
    prompts = []
    for task in tasks:
        for L in lengths:
            for i in range(samples):
                s = make_sample(task, tokenizer, L, i, frame=frame, seed=seed, max_new_tokens=max_new_tokens,
                                essay_units=units)
                prompts.append({"task": task, "length": L, "index": i, "ids": s.ids, "outputs": s.outputs,
                                "max_new_tokens": s.max_new_tokens, "prompt_tokens": len(s.ids)})
    return prompts, units


def run_ruler(
    model: Any,
    *,
    tasks: list[str] | tuple[str, ...] = DEFAULT_TASKS,
    lengths: list[int] | tuple[int, ...] = DEFAULT_LENGTHS,
    samples: int = 5,
    haystack: str = essays.ESSAYS,
    max_new_tokens: int | None = None,
    chat_template: str = "auto",
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    seed: int = 0,
    bos: str = "auto",
    zero_shot: list[str] | tuple[str, ...] = (),
    **options: Any,
) -> dict:
    """RULER scores (percent) per task x length for ``model`` (and ``baseline``), on the same prompts.

    tasks: names from :data:`retrofit.eval.ruler_tasks.TASKS`. lengths: sequence lengths in
    tokens (prompt + answer budget, as RULER counts them). samples: prompts per (task, length).
    haystack: the essay tasks' text (``essays`` = Paul Graham's, else a corpus name or path).
    max_new_tokens: the generation bound (default: each task's RULER budget). chat_template:
    auto | on | off. prefill_chunk: chunked prefill above this many tokens (0 or None: one prefill).
    zero_shot: variant specs scored beside the two (:mod:`retrofit.eval.variants`), e.g. ``yarn:4``, ``closed``.
    options: tokenizer, baseline, baseline_tokenizer, device, dtype, rope_cap, out, progress,
        command (:class:`retrofit.eval.options.RunOptions`).
    Returns the results dict; with ``out``, writes results.json, table.md, ruler.png.
    """
    opts = run_options("run_ruler", options)
    tasks = list(dict.fromkeys(tasks))
    for t in tasks:
        get_task(t)
    lengths = sorted(set(int(x) for x in lengths))
    if samples < 1:
        raise DataError("samples must be at least 1")
    check_prefill_chunk(prefill_chunk)
    hay = essays.resolve_haystack(haystack) if any(get_task(t).haystack == "essay" for t in tasks) else None
    run = setup(model, options=opts, zero_shot=zero_shot, bos=bos, chat_template=chat_template)
    roles, tok, use_bos, chat, frame = run.roles, run.tokenizer, run.use_bos, run.chat, run.frame
    prompts, units = build_prompts(tok, tasks=tasks, lengths=lengths, samples=samples, frame=frame, seed=seed,
                                   max_new_tokens=max_new_tokens, haystack=hay)

    records, seconds, attention = run_prompts(
        roles, prompts, score=lambda p, text: recall(text, p["outputs"]),
        max_new_tokens=lambda p, _tok: p["max_new_tokens"], prefill_chunk=prefill_chunk, desc="ruler",
        progress=opts.progress, keep=("task", "index", "outputs", "prompt_tokens"),
    )
    results: dict[str, dict] = {}
    for role, recs in records.items():
        scores = {t: {str(L): mean_or_none([r["score"] for r in recs if r["task"] == t and r["length"] == L])
                      for L in lengths} for t in tasks}
        average = {str(L): mean_or_none([scores[t][str(L)] for t in tasks]) for L in lengths}
        results[role] = {"scores": scores, "average": average,
                         "mean": mean_or_none([r["score"] for r in recs]),
                         "samples": recs, "seconds_per_length": seconds[role]}

    res = {
        "kind": "ruler",
        "models": {role: loading.model_info(mdl, label) for role, (mdl, _, label) in roles.items()},
        "settings": {
            "tasks": tasks, "lengths": lengths, "samples": samples, "seed": seed, "bos_used": use_bos,
            "chat_template": chat, "haystack": hay.describe() if hay else None,
            "haystack_repeated": bool(units and units.repeated),
            "max_new_tokens": {t: (max_new_tokens or get_task(t).max_new_tokens) for t in tasks},
            "prefill_chunk": prefill_chunk or None, "device": opts.device, "dtype": opts.dtype,
            "decoding": "greedy, model.generate", "scoring": "string_match_all (recall of expected strings)",
            "attention": attention,
        },
        "results": results,
    }
    hay_text = f" Essay haystack: {hay.name}{' (fallback)' if hay.fallback else ''}." if hay else ""
    description = (
        f"RULER-style synthetic tasks (score %, recall of the expected strings in the greedy answer, "
        f"{samples} sample(s) per cell); rows: tasks; columns: sequence length in tokens (prompt + "
        f"answer budget, as RULER counts it). Chat template: {'on' if chat else 'off'}.{hay_text}"
    ) + copied_note(records)
    return opts.finish(res, description=description, table=table_markdown, plot=plot_heatmap, image="ruler.png")


def _fmt(v: float | None) -> str:
    return "OOM" if v is None else f"{100 * v:.1f}"


def table_markdown(res: dict) -> str:
    """One block per model: rows tasks (+ average), columns lengths; scores in percent."""
    lengths = res["settings"]["lengths"]
    tasks = res["settings"]["tasks"]
    header = ["Model", "Task"] + [report.fmt_length(L) for L in lengths]
    rows = []
    for role in res["results"]:  # in table order (baseline first)
        label = res["models"][role]["label"]
        r = res["results"][role]
        for i, t in enumerate(tasks):
            rows.append([label if i == 0 else "", t, *[_fmt(r["scores"][t][str(L)]) for L in lengths]])
        rows.append(["", "average", *[_fmt(r["average"][str(L)]) for L in lengths]])
    return report.markdown_table(header, rows, align=["l", "l"] + ["r"] * len(lengths))


def plot_heatmap(res: dict, path: str | Path) -> Path:
    """Score heat map (tasks + average x lengths), one panel per model."""
    import numpy as np

    plt = report.pyplot()
    lengths = res["settings"]["lengths"]
    rows = [*res["settings"]["tasks"], "average"]
    roles = list(res["results"])  # table order (baseline first)
    width = len(roles) * (2.6 + 0.75 * len(lengths)) + 1.2
    fig, axes = plt.subplots(1, len(roles), figsize=(width, 0.4 * len(rows) + 2.0), squeeze=False,
                             constrained_layout=True)
    im = None
    for k, (ax, role) in enumerate(zip(axes[0], roles)):
        r = res["results"][role]
        grid = [r["scores"][t] for t in rows[:-1]] + [r["average"]]
        data = np.array([[np.nan if g[str(L)] is None else g[str(L)] for L in lengths] for g in grid], dtype=float)
        im = ax.imshow(data, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [report.fmt_length(L) for L in lengths])
        ax.set_yticks(range(len(rows)), rows if k == 0 else [""] * len(rows))
        ax.axhline(len(rows) - 1.5, color="black", linewidth=0.8)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(res["models"][role]["label"], fontsize=10)
        report.label_cells(ax, data)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="score")
    fig.suptitle(f"RULER-style tasks (chat template {'on' if res['settings']['chat_template'] else 'off'})")
    path = save_figure_atomic(fig, path)
    plt.close(fig)
    return path
