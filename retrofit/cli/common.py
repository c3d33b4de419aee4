"""What every verb shares: ``--help`` that shows defaults, ``-q`` / ``-v``, muted third-party noise.

``retrofit.cli.main`` applies :func:`finish_parser` to every (sub)command parser after the verbs
have registered, so a verb module only declares its own options, and :func:`configure_output`
before a handler runs:

* default: transformers logs only errors (no load report, no advisory warnings), DeepSpeed's
  "Setting accelerator to CPU" notice is dropped, retrofit's own log lines show;
* ``-q``: also no progress bars and only warnings from retrofit;
* ``-v``: everything third-party libraries say (transformers at info level, DeepSpeed notices).

Environment variables are used where a library reads them at import (``TRANSFORMERS_VERBOSITY``),
so nothing heavy is imported here.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

__all__ = ["HelpFormatter", "configure_output", "finish_parser", "print_json"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; an option's default appended unless its help states one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text.lower()
            or action.default in (None, False, argparse.SUPPRESS, [], "")
            or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))  # a flag's default is its absence
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return text
        return f"{text} (default: %(default)s)"


def _subcommand_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.extend(dict.fromkeys(action.choices.values()))  # aliases map to the same parser
    return out


def finish_parser(parser: argparse.ArgumentParser) -> None:
    """Defaults in ``--help`` and ``-q`` / ``-v`` on ``parser`` and every sub-command below it."""
    subs = _subcommand_parsers(parser)
    if parser.formatter_class in (argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter):
        parser.formatter_class = HelpFormatter
    if not subs:
        _add_verbosity(parser)
        parser.set_defaults(command_prog=parser.prog)  # what its error lines start with (retrofit.cli.main)
    for child in subs:
        finish_parser(child)


def _add_verbosity(parser: argparse.ArgumentParser) -> None:
    taken = parser._option_string_actions
    quiet = taken.get("--quiet")
    if quiet is not None:  # a verb's own --quiet (no progress bars) gains the short form
        if "-q" not in taken:
            quiet.option_strings.append("-q")
            taken["-q"] = quiet
    elif "-q" not in taken:
        parser.add_argument("-q", "--quiet", action="store_true",
                            help="only warnings and errors; no progress bars or third-party notices")
    if "-v" not in taken and "--verbose" not in taken:
        parser.add_argument("-v", "--verbose", action="store_true",
                            help="also show what transformers / DeepSpeed / lm-eval log (load reports, notices)")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (not the stream at set-up:
    a caller that swaps stderr, as test captures do, would leave it writing to a closed file)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


class _DropBelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_DROP = _DropBelowError()


def configure_output(args: argparse.Namespace) -> None:
    """Apply ``-q`` / ``-v`` (see the module docstring); call before the handler imports libraries."""
    verbose = bool(getattr(args, "verbose", False))
    quiet = bool(getattr(args, "quiet", False)) and not verbose
    retrofit_log = logging.getLogger("retrofit")
    if not retrofit_log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[retrofit] %(levelname)s: %(message)s"))
        retrofit_log.addHandler(handler)
        retrofit_log.propagate = False
    retrofit_log.setLevel(logging.WARNING if quiet else (logging.DEBUG if verbose else logging.INFO))
    if verbose:
        os.environ["TRANSFORMERS_VERBOSITY"] = "info"
        logging.getLogger("DeepSpeed").removeFilter(_DROP)
        _set_transformers_verbosity(logging.INFO)
        return
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers is first imported
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # DeepSpeed's logger is created (level WARNING) at its import; a filter set now survives that
    logging.getLogger("DeepSpeed").addFilter(_DROP)
    for name in ("lm-eval", "lm_eval", "accelerate", "datasets", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR if quiet else logging.WARNING)
    _set_transformers_verbosity(logging.ERROR)
    if quiet:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["TQDM_DISABLE"] = "1"
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()


def _set_transformers_verbosity(level: int) -> None:
    if "transformers" in sys.modules:  # already imported (tests, Python callers): set it directly
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(level)


def print_json(data: dict) -> None:
    """One JSON document on stdout (``--json`` summaries)."""
    import json

    print(json.dumps(data, indent=2, sort_keys=True, default=str))
