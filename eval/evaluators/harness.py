"""``retrofit eval harness``: lm-eval few-shot benchmarks (paper Table 5)."""
from __future__ import annotations

import argparse
import math

from retrofit.errors import RetrofitError
from retrofit.eval.choice_generation import DEFAULT_MAX_NEW_TOKENS, SCORES
from retrofit.eval.evaluators import MAX_NEW_TOKENS, Evaluator, check_new_tokens, register_evaluator
from retrofit.eval.harness import PAPER_TASKS, fewshot_for, parse_fewshot

_DEFAULT_TASKS = ",".join(PAPER_TASKS)


def add_arguments(p: argparse.ArgumentParser, prefix: str) -> None:
    g = p.add_argument_group("lm-eval")
    g.add_argument("--tasks", default=_DEFAULT_TASKS, help=f"comma-separated lm-eval tasks (default: {_DEFAULT_TASKS})")
    g.add_argument("--num-fewshot",
                   help="N for every task, or task=N,... (default: the paper-table map in retrofit.eval.harness)")
    g.add_argument("--limit", type=float, help="examples per task (smoke runs; <1 = fraction)")
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--max-length", type=int, help="lm-eval context limit (default: from the model config)")
    g.add_argument("--include-path", nargs="+", default=[], help="extra folders of lm-eval task YAMLs")
    g.add_argument("--bootstrap-iters", type=int, default=1000, help="bootstrap samples for stderr (0 = none)")
    g.add_argument("--score", choices=SCORES, default="both",
                   help="multiple-choice tasks scored by log-likelihood (lm-eval's way), by generation (lettered "
                        "choices answered greedily, exact match of letter or text: columns TASK:gen), or both "
                        "(default)")
    g.add_argument("--gen-max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help=f"bound on generated multiple-choice answers, at most {MAX_NEW_TOKENS} "
                        f"(default {DEFAULT_MAX_NEW_TOKENS})")


def kwargs(args: argparse.Namespace) -> dict:
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    return dict(
        tasks=args.tasks, num_fewshot=args.num_fewshot, limit=limit, batch_size=args.batch_size,
        max_length=args.max_length, include_path=args.include_path, bootstrap_iters=args.bootstrap_iters,
        seed=args.seed, score=args.score, max_new_tokens=args.gen_max_new_tokens,
    )


def check(args: argparse.Namespace) -> None:
    """Flags lm-eval would reject only after the models load fail here, with what to pass instead:
    a ``--limit`` that is not positive (or not a whole number from 1 up), a malformed ``--num-fewshot``,
    and a few-shot count larger than a task's pool of few-shot examples."""
    limit = getattr(args, "limit", None)
    if limit is not None:
        if not math.isfinite(limit):
            raise RetrofitError(f"--limit {limit}: pass a count of examples per task (e.g. --limit 100) or a "
                                "fraction in (0, 1)")
        if limit <= 0:
            raise RetrofitError(f"--limit {limit:g} selects no examples: pass a count of examples per task "
                                "(e.g. --limit 100), a fraction in (0, 1) (e.g. --limit 0.1), or leave it out")
        if limit >= 1 and limit != int(limit):
            raise RetrofitError(f"--limit {limit:g}: a count of examples must be a whole number (e.g. --limit "
                                f"{int(limit)}); fractions of a task are in (0, 1)")
    for flag, value, low in (("--batch-size", getattr(args, "batch_size", 1), 1),
                             ("--max-length", getattr(args, "max_length", None), 1),
                             ("--bootstrap-iters", getattr(args, "bootstrap_iters", 0), 0),
                             ("--gen-max-new-tokens", getattr(args, "gen_max_new_tokens", None), 1)):
        if value is not None and value < low:
            raise RetrofitError(f"{flag} must be >= {low}, got {value}"
                                + (" (0 = no stderr)" if flag == "--bootstrap-iters" else ""))
    check_new_tokens("--gen-max-new-tokens", getattr(args, "gen_max_new_tokens", None))
    if getattr(args, "num_fewshot", None) is None:
        return
    fewshot = parse_fewshot(args.num_fewshot)
    counts = [fewshot] if isinstance(fewshot, int) else list((fewshot or {}).values())
    if any(n > MAX_FEWSHOT for n in counts):
        raise RetrofitError(f"--num-fewshot {args.num_fewshot}: retrofit takes at most {MAX_FEWSHOT} "
                            "few-shot examples (the paper's tables use 0 to 25); pass a smaller count")
    _check_fewshot_pools(args, fewshot)


MAX_FEWSHOT = 1000


def _check_fewshot_pools(args: argparse.Namespace, fewshot) -> None:
    """Each task's few-shot pool holds more than N examples (lm-eval draws N + 1 and drops the scored one)."""
    tasks = [t.strip() for t in str(getattr(args, "tasks", "") or "").split(",") if t.strip()]
    if not tasks:
        return
    try:  # only the task files and their (cached) data: no model
        import logging
        import warnings

        from lm_eval.tasks import get_task_dict

        from retrofit.eval.harness import task_manager

        log = logging.getLogger("lm-eval")
        level = log.level
        log.setLevel(logging.ERROR)  # the run itself logs what loading the tasks says
        try:
            tm = task_manager(tasks, getattr(args, "include_path", None) or [])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = {name: get_task_dict([name], tm) for name in tasks}
        finally:
            log.setLevel(level)
    except RetrofitError:
        raise
    except Exception:  # noqa: BLE001 - tasks that do not load here fail the same way in the run
        return

    def leaves(d: dict):
        for value in d.values():
            if isinstance(value, dict):
                yield from leaves(value)
            else:
                yield value

    for name, tree in loaded.items():
        n = fewshot_for(name, fewshot)
        if not n:
            continue
        for task in leaves(tree):
            try:
                pool = len(task.fewshot_docs())
            except Exception:  # noqa: BLE001 - a pool that cannot be counted is left to lm-eval
                continue
            if n >= pool:
                label = getattr(task.config, "task", None) or name
                raise RetrofitError(f"--num-fewshot {n} for {label}: its few-shot pool has {pool} examples "
                                    f"(one is the scored example itself): pass --num-fewshot {max(pool - 1, 0)} "
                                    f"or less (per task: {name}=N)")


EVALUATOR = register_evaluator(Evaluator(
    name="harness", command="harness", subdir="harness", heading="Few-shot benchmarks (lm-eval)",
    help="lm-eval few-shot benchmarks (paper Table 5)",
    add_arguments=add_arguments, kwargs=kwargs, run="retrofit.eval.harness:run_harness", check=check,
    uses_seed=True, order=20, label="lm-eval",
))
