"""Few-shot benchmarks through lm-eval, a converted model beside its base (the paper's Table 5).

Few-shot counts: the Latte paper does not state them. We use the convention its Gemma-2 2B
numbers match, that of the Gemma model cards and the Open LLM Leaderboard v1:

    task            num_fewshot  reported metric
    mmlu            5            acc
    hellaswag       10           acc_norm (dagger)
    lambada_openai  0            acc
    arc_challenge   25           acc_norm (dagger)
    arc_easy        0            acc
    winogrande      5            acc
    piqa            0            acc_norm (dagger)
    boolq           0            acc

Override with ``num_fewshot`` (an int for every task, or a ``{task: n}`` map). Tasks outside
the map use their YAML default. Local task YAMLs (like ``eval/tasks/retrofit_tiny``) load with
``include_path``; the bundled ``eval/tasks`` folder is always searched.

Scoring (``score``): multiple-choice tasks are scored by log-likelihood (``loglik``, lm-eval's
way), by generation (``generation``: the lettered prompt of
:mod:`retrofit.eval.choice_generation`, answered greedily, scored by exact match of the letter or
the choice text, reported as the task ``<task>:gen``), or ``both`` (the default: the two columns
side by side). Other tasks are scored their own way in every mode.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from retrofit.errors import RetrofitError
from retrofit.eval import choice_generation, loading, report, variants
from retrofit.fs.atomic import save_figure_atomic

PAPER_TASKS = ("mmlu", "hellaswag", "lambada_openai", "arc_challenge", "arc_easy", "winogrande", "piqa", "boolq")
PAPER_FEWSHOT: dict[str, int] = {
    "mmlu": 5,
    "hellaswag": 10,
    "lambada_openai": 0,
    "arc_challenge": 25,
    "arc_easy": 0,
    "winogrande": 5,
    "piqa": 0,
    "boolq": 0,
}
PRIMARY_METRIC: dict[str, str] = {
    "mmlu": "acc",
    "hellaswag": "acc_norm",
    "lambada_openai": "acc",
    "arc_challenge": "acc_norm",
    "arc_easy": "acc",
    "winogrande": "acc",
    "piqa": "acc_norm",
    "boolq": "acc",
}
_FALLBACK_METRICS = ("acc_norm", "acc", "exact_match", "word_perplexity", "f1", "mcc")
_PERCENT_METRICS = ("acc", "acc_norm", "exact_match", "f1", "mcc")
SCORES = choice_generation.SCORES
TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def parse_fewshot(spec: str | int | dict | None) -> int | dict[str, int] | None:
    """``"5"`` -> 5; ``"hellaswag=10,piqa=0"`` -> {...}; dict/int/None pass through. Counts must be >= 0."""
    from retrofit.errors import SpecError

    def count(value: Any, where: str) -> int:
        try:
            n = int(value)
        except (TypeError, ValueError):
            raise SpecError(f"num_fewshot: {where} {value!r} is not a whole number") from None
        if n < 0 or isinstance(value, bool):
            raise SpecError(f"num_fewshot: {where} must be >= 0, got {value!r}")
        return n

    if spec is None:
        return None
    if isinstance(spec, dict):
        return {k: count(v, f"task {k}") for k, v in spec.items()}
    if isinstance(spec, int):
        return count(spec, "the count")
    spec = spec.strip()
    if not spec:
        return None
    if "=" not in spec:
        return count(spec, "the count")
    out = {}
    for item in spec.split(","):
        k, _, v = item.partition("=")
        out[k.strip()] = count(v, f"task {k.strip()}")
    return out


def fewshot_for(task: str, override: int | dict[str, int] | None) -> int | None:
    if isinstance(override, int):
        return override
    if isinstance(override, dict) and task in override:
        return override[task]
    return PAPER_FEWSHOT.get(task)


def task_manager(tasks: list[str], include_path: list[str | Path] | None = None):
    """A TaskManager over our task folders; lm-eval's ~10k built-in tasks are indexed only if needed."""
    from retrofit.extras import require

    TaskManager = require("lm_eval.tasks", "lm-eval benchmarks").TaskManager

    paths = [str(TASKS_DIR)] + [str(p) for p in (include_path or [])]
    for p in paths[1:]:
        if not Path(p).exists():
            raise RetrofitError(f"include path {p} does not exist")
    tm = TaskManager(include_path=paths, include_defaults=False)
    if all(t in tm.all_tasks for t in tasks):
        return tm
    tm = TaskManager(include_path=paths, include_defaults=True)
    missing = [t for t in tasks if t not in tm.all_tasks]
    if missing:
        raise RetrofitError(
            f"unknown lm-eval task(s): {', '.join(missing)}. List tasks with `lm_eval ls tasks`; "
            f"local YAMLs go in a folder passed with --include-path."
        )
    return tm


def _metrics(entry: dict) -> dict[str, float]:
    """lm-eval's ``{"acc,none": x, "acc_stderr,none": s, "alias": ...}`` -> ``{"acc": x, "acc_stderr": s}``."""
    out: dict[str, float] = {}
    for key, val in entry.items():
        if key == "alias" or not isinstance(val, (int, float)):
            continue
        name, _, filt = key.partition(",")
        out[name if filt in ("none", "") else f"{name},{filt}"] = float(val)
    return out


def primary(task: str, metrics: dict[str, float]) -> tuple[str | None, float | None]:
    want = PRIMARY_METRIC.get(task)
    if want and want in metrics:
        return want, metrics[want]
    for m in _FALLBACK_METRICS:
        for k, v in metrics.items():
            if k == m or k.startswith(m + ","):
                return k, v
    return None, None


def evaluate_model(
    lm: Any,
    tasks: list[str],
    *,
    num_fewshot: int | dict[str, int] | None = None,
    limit: int | float | None = None,
    include_path: list[str | Path] | None = None,
    bootstrap_iters: int = 1000,
    seed: int = 1234,
    gen_kwargs: str | dict | None = None,
    score: str = "loglik",
    max_new_tokens: int = choice_generation.DEFAULT_MAX_NEW_TOKENS,
) -> dict:
    """Run lm-eval on one LM instance; tasks with different few-shot counts run in separate calls.

    score: ``loglik`` / ``generation`` / ``both`` for the multiple-choice tasks (module docstring);
    max_new_tokens bounds their generated answers.
    """
    from retrofit.extras import require

    simple_evaluate = require("lm_eval", "lm-eval benchmarks").simple_evaluate

    tm = task_manager(tasks, include_path)
    groups: dict[int | None, list[str]] = {}
    for t in tasks:
        groups.setdefault(fewshot_for(t, num_fewshot), []).append(t)
    merged: dict[str, Any] = {
        "results": {}, "n-shot": {}, "n-samples": {}, "versions": {}, "groups": {}, "group_subtasks": {},
    }
    if score not in SCORES:
        raise RetrofitError(f"score {score!r}: use one of {', '.join(SCORES)}")
    for k, group in groups.items():
        runs: list[tuple[list, dict[str, list[str]]]] = []
        if score in ("loglik", "both"):
            runs.append((list(group), {}))
        if score in ("generation", "both"):
            runs.append(_generation_tasks(tm, group, score == "generation", max_new_tokens))
        for task_list, group_map in runs:
            if not task_list:
                continue
            res = simple_evaluate(
                model=lm, tasks=task_list, num_fewshot=k, limit=limit, task_manager=tm,
                bootstrap_iters=bootstrap_iters, log_samples=False, random_seed=seed,
                numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                gen_kwargs=gen_kwargs,
            )
            if res is None:  # non-zero rank in a distributed run
                continue
            for key in merged:
                merged[key].update(res.get(key, {}) or {})
            for name, entry in choice_generation.group_scores(merged["results"], group_map,
                                                               merged["n-samples"]).items():
                merged["results"][name] = entry
                merged["n-shot"][name] = k
            for name, children in group_map.items():
                merged["group_subtasks"].setdefault(name, children)
    return merged


def _generation_tasks(tm: Any, names: list[str], others_too: bool,
                      max_new_tokens: int) -> tuple[list, dict[str, list[str]]]:
    """The generation variants of the multiple-choice tasks among ``names`` (groups opened up to
    their leaves); with ``others_too`` the other leaf tasks as well. Also the group map."""
    loaded = tm.load(list(names))
    tasks = []
    for task in loaded["tasks"].values():
        if task.OUTPUT_TYPE == "multiple_choice":
            tasks.append(choice_generation.generation_variant(task, max_new_tokens))
        elif others_too:
            tasks.append(task)
    return tasks, dict(loaded.get("group_map") or {})


def run_harness(
    model: Any,
    *,
    tokenizer: Any = None,
    baseline: Any = None,
    baseline_tokenizer: Any = None,
    tasks: list[str] | tuple[str, ...] | str = PAPER_TASKS,
    num_fewshot: int | dict[str, int] | str | None = None,
    limit: int | float | None = None,
    batch_size: int = 1,
    max_length: int | None = None,
    include_path: list[str | Path] | None = None,
    bootstrap_iters: int = 1000,
    seed: int = 1234,
    device: str = "cpu",
    dtype: str | None = None,
    rope_cap: int | None = None,
    out: str | Path | None = None,
    command: str | None = None,
    zero_shot: list[str] | tuple[str, ...] = (),
    score: str = "both",
    max_new_tokens: int = choice_generation.DEFAULT_MAX_NEW_TOKENS,
) -> dict:
    """lm-eval few-shot benchmarks for ``model`` (and ``baseline``); JSON + markdown table.

    model / baseline: name or path (loaded by retrofit), or a loaded model with its tokenizer.
    tasks: lm-eval task or group names (list or comma-separated string).
    num_fewshot: None = :data:`PAPER_FEWSHOT` (task default elsewhere); an int; or a map.
    limit: examples per task (for smoke runs). include_path: extra folders of task YAMLs.
    zero_shot: variant specs scored beside the two (:mod:`retrofit.eval.variants`).
    score: multiple-choice tasks by ``loglik``, ``generation`` or ``both`` (columns ``<task>`` and
    ``<task>:gen``); max_new_tokens bounds the generated answers.
    """
    from retrofit.eval.lm_model import RetrofitLM

    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    tasks = list(tasks)
    if not tasks:
        raise RetrofitError("no tasks given")
    if score not in SCORES:
        raise RetrofitError(f"score {score!r}: use one of {', '.join(SCORES)}")
    fewshot = parse_fewshot(num_fewshot)
    resolved = variants.resolve_roles(model, tokenizer, baseline, baseline_tokenizer,
                                      variants=variants.parse_variants(zero_shot), device=device, dtype=dtype,
                                      rope_cap=rope_cap)
    models: dict[str, dict] = {}
    raw: dict[str, dict] = {}
    for role, (m, t, label) in resolved.items():
        lm = RetrofitLM(pretrained=m, tokenizer=t, batch_size=batch_size, max_length=max_length)
        t0 = time.perf_counter()
        raw[role] = evaluate_model(
            lm, tasks, num_fewshot=fewshot, limit=limit, include_path=include_path,
            bootstrap_iters=bootstrap_iters, seed=seed, score=score, max_new_tokens=max_new_tokens,
        )
        models[role] = {**loading.model_info(m, label), "seconds": time.perf_counter() - t0}
        del lm

    results: dict[str, dict[str, dict]] = {}
    for role, r in raw.items():
        for task_name, entry in r["results"].items():
            metrics = _metrics(entry)
            pname, pval = primary(task_name, metrics)
            results.setdefault(task_name, {})[role] = {
                "metrics": metrics, "primary_metric": pname, "primary": pval,
                "num_fewshot": r["n-shot"].get(task_name), "samples": r["n-samples"].get(task_name),
            }
    res = {
        "kind": "harness",
        "models": models,
        "tasks": tasks,
        "settings": {
            "num_fewshot": {t: fewshot_for(t, fewshot) for t in tasks},
            "limit": limit, "batch_size": batch_size, "bootstrap_iters": bootstrap_iters, "seed": seed,
            "include_path": [str(p) for p in (include_path or [])], "device": device, "dtype": dtype,
            "score": score, "max_new_tokens": max_new_tokens,
        },
        "results": results,
        "lm_eval": {
            role: {k: r[k] for k in ("n-shot", "versions", "n-samples", "group_subtasks")} for role, r in raw.items()
        },
    }
    if command:
        res["command"] = command
    res["description"] = (
        "Scores in percent (accuracy, or normalized accuracy where marked with a dagger); "
        "perplexity-type metrics as is. Few-shot counts in brackets."
        + (f" `:gen` columns: multiple-choice tasks answered by greedy generation (choices lettered, "
           f"at most {max_new_tokens} new tokens), exact match of the letter or the choice text."
           if score != "loglik" else "")
        + (f" Limited to {limit} examples per task." if limit else "")
    )
    res["table"] = table_markdown(res)
    return report.finish_results(res, out, plot_scores, "harness.png")


def _columns(res: dict) -> list[str]:
    """Requested tasks in order; a group without its own score is replaced by its subtasks."""
    subtasks: dict[str, list[str]] = {}
    for r in res.get("lm_eval", {}).values():
        subtasks.update(r.get("group_subtasks", {}))

    def has_score(t: str) -> bool:
        return any(e.get("primary") is not None for e in res["results"].get(t, {}).values())

    cols: list[str] = []

    def visit(t: str) -> None:
        if has_score(t):
            cols.append(t)
        else:
            for sub in subtasks.get(t, []):
                visit(sub)
        gen = choice_generation.variant_name(t)
        if has_score(gen):  # its generation score beside its log-likelihood one
            cols.append(gen)

    for t in res["tasks"]:
        visit(t)
    return list(dict.fromkeys(cols))


def table_markdown(res: dict) -> str:
    """Rows: models (baseline first); columns: tasks, as in the paper's Table 5."""
    cols = _columns(res)
    header = ["Model"]
    for t in cols:
        any_entry = next(iter(res["results"][t].values()))
        metric = any_entry.get("primary_metric") or "?"
        mark = "\u2020" if metric.startswith("acc_norm") else ""
        shots = any_entry.get("num_fewshot")
        header.append(f"{t}{mark}" + (f" [{shots}]" if shots is not None else ""))
    rows = []
    for role in report.role_order(res["models"]):
        row = [res["models"][role]["label"]]
        for t in cols:
            e = res["results"][t].get(role)
            val = None if e is None else e.get("primary")
            metric = (e or {}).get("primary_metric") or ""
            if val is not None and metric.split(",")[0] in _PERCENT_METRICS:
                val = 100.0 * val
            row.append(report.fmt_num(val))
        rows.append(row)
    return report.markdown_table(header, rows)


def plot_scores(res: dict, path: str | Path) -> Path | None:
    """Grouped bars of the percent-type primary metrics, one bar per model; None if nothing to plot."""
    import numpy as np

    roles = report.role_order(res["models"])
    cols = []
    for t in _columns(res):
        metric = next(iter(res["results"][t].values())).get("primary_metric") or ""
        if metric.split(",")[0] in _PERCENT_METRICS:
            cols.append(t)
    if not cols:
        return None
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(cols) + 1.5), 3.6), constrained_layout=True)
    x = np.arange(len(cols))
    width = 0.8 / len(roles)
    for i, role in enumerate(roles):
        vals = [100.0 * (res["results"][t].get(role, {}).get("primary") or 0.0) for t in cols]
        ax.bar(x + (i - (len(roles) - 1) / 2) * width, vals, width, label=res["models"][role]["label"])
    ax.set_xticks(x, cols, rotation=30, ha="right")
    ax.set_ylabel("score (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Few-shot benchmarks")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    out = save_figure_atomic(fig, path)
    plt.close(fig)
    return out
