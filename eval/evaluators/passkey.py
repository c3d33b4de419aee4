"""``retrofit eval passkey``: passkey retrieval over lengths x depths (a heat map)."""
from __future__ import annotations

import argparse

from retrofit.eval.evaluators import Evaluator, count_arg, depth_arg, length_arg, register_evaluator
from retrofit.eval.evaluators._generation import add_generation_arguments


def add_arguments(p: argparse.ArgumentParser, prefix: str) -> None:
    g = p.add_argument_group("passkey")
    g.add_argument(f"--{prefix}lengths", dest="passkey_lengths", type=length_arg, nargs="+", metavar="L",
                   default=[1024, 2048, 4096, 8192, 16384, 32768], help="prompt lengths (default 1K..32K)")
    g.add_argument("--depths", type=depth_arg, nargs="+", metavar="D", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths in [0, 1] (default 0 0.25 0.5 0.75 1)")
    g.add_argument("--trials", type=count_arg(1), default=5, help="prompts per (length, depth) cell")
    g.add_argument("--haystack", default="pg-books", help="corpus for the filler text (default pg-books), or noise: the classic filler "
                        "(\"The grass is green. The sky is blue. ...\" repeated)")
    g.add_argument("--key-digits", type=count_arg(1), default=5, help="digits of the passkey (default 5)")
    add_generation_arguments(p)


def kwargs(args: argparse.Namespace) -> dict:
    return dict(
        lengths=args.passkey_lengths, depths=args.depths, trials=args.trials, haystack=args.haystack,
        key_digits=args.key_digits, seed=args.seed, bos=args.bos, progress=not args.quiet,
        prefill_chunk=args.prefill_chunk, chat_template=args.chat_template,
    )


def check(args: argparse.Namespace) -> None:
    from retrofit.errors import RetrofitError

    shortest = min(args.passkey_lengths)
    if args.key_digits >= shortest:  # each digit is a token at least: the key alone would fill the prompt
        raise RetrofitError(f"--key-digits {args.key_digits} does not fit a prompt of {shortest} tokens (the shortest "
                            "of --lengths): give fewer digits (default 5)")


EVALUATOR = register_evaluator(Evaluator(
    name="passkey", command="passkey", subdir="passkey", heading="Passkey retrieval",
    help="passkey retrieval over lengths x depths (heat map)",
    add_arguments=add_arguments, kwargs=kwargs, run="retrofit.eval.passkey:run_passkey", check=check,
    precheck="retrofit.eval.passkey:check_lengths",
    uses_bos=True, uses_seed=True, reads_text=True, order=30,
))
