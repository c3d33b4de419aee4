"""``retrofit eval harness``: lm-eval few-shot benchmarks (paper Table 5)."""
from __future__ import annotations

import argparse

from retrofit.eval.choice_generation import DEFAULT_MAX_NEW_TOKENS, SCORES
from retrofit.eval.evaluators import Evaluator, register_evaluator
from retrofit.eval.harness import PAPER_TASKS, parse_fewshot

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
                   help=f"bound on generated multiple-choice answers (default {DEFAULT_MAX_NEW_TOKENS})")


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
    """A malformed ``--num-fewshot`` fails before any model loads."""
    if getattr(args, "num_fewshot", None) is not None:
        parse_fewshot(args.num_fewshot)


EVALUATOR = register_evaluator(Evaluator(
    name="harness", command="harness", subdir="harness", heading="Few-shot benchmarks (lm-eval)",
    help="lm-eval few-shot benchmarks (paper Table 5)",
    add_arguments=add_arguments, kwargs=kwargs, run="retrofit.eval.harness:run_harness", check=check,
    uses_seed=True, order=20, label="lm-eval",
))
