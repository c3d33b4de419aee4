"""Flags that every generation-scored evaluator (passkey, RULER, NIAH) shares.

Added once per parser whichever evaluator comes first, so ``retrofit eval all`` has one
``--chat-template`` and one ``--prefill-chunk`` for all of them (the other flags of those
evaluators take the ``<command>-`` prefix there).
"""
from __future__ import annotations

import argparse

from retrofit.eval.evaluators import count_arg


def _has(p: argparse.ArgumentParser, flag: str) -> bool:
    return flag in p._option_string_actions  # argparse keeps no public index of its flags


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    """``--chat-template auto|on|off`` and ``--prefill-chunk TOKENS``, unless the parser has them."""
    g = p.add_argument_group("generation (passkey, RULER, NIAH)")
    if not _has(p, "--chat-template"):
        g.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                       help="wrap retrieval prompts in the tokenizer's chat template (the question as the user "
                            "turn, the answer's opening words after the assistant header); auto: when the "
                            "tokenizer has one (default auto)")
    if not _has(p, "--prefill-chunk"):
        g.add_argument("--prefill-chunk", type=count_arg(0), default=4096, metavar="TOKENS",
                       help="run a longer prompt through the model's cache this many tokens at a time before "
                            "generating (bounded memory; the same answer as one prefill); 0 = one prefill "
                            "(default 4096)")
