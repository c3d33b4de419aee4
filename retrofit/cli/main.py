"""`retrofit` command line: verbs over YAML recipes, like litgpt / torchtune.

Each verb lives in its own module (``retrofit/cli/<verb>.py``) exposing
``add_parser(subparsers, help_text)`` (its sub-command and flags); heavy imports happen inside the verb's handler so that
``retrofit --help`` stays instant.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import sys

from retrofit import __version__
from retrofit.cli.common import HelpFormatter, configure_output, finish_parser

VERBS: tuple[tuple[str, str], ...] = (
    ("convert", "model surgery: swap attention for a linear-time method and save a checkpoint"),
    ("train", "continual pretraining of the new weights (DeepSpeed / torchrun / single process)"),
    ("fit", "fit a Hedgehog read to the base's attention layer by layer (no network training; CPU-friendly)"),
    ("eval", "evaluate a model beside a baseline"),  # retrofit.cli.eval appends the registered commands
    ("generate", "constant-memory text generation from a converted checkpoint"),
    ("bench", "speed and memory benchmarks (attention ops, decoding, whole model)"),
    ("demo", "a recipe's whole job on a real model: convert, train or fit, eval, generate, one report "
             "(default: Gemma 3 270M)"),
    ("ls", "list the bundled recipes, convert specs, datasets and DeepSpeed configs"),
)


EPILOG = """\
retrofit VERB --help for a verb's options (e.g. retrofit convert --help); a verb with commands
lists them there, and retrofit VERB COMMAND --help gives a command's (e.g. retrofit eval ppl --help).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retrofit",
        description="Give pretrained LLMs linear-time attention and a longer usable context.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"retrofit {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, help_text in VERBS:
        module = importlib.import_module(f"retrofit.cli.{name}")
        module.add_parser(sub, help_text)
    finish_parser(parser)  # defaults in every --help, -q / -v on every verb
    return parser


_interrupted = False  # set by the SIGINT handler: a later failure is the interrupt's, whoever caught it


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _catch_interrupts() -> None:
    """Record every Ctrl-C: a library that catches the KeyboardInterrupt mid-import (numpy, half set up)
    makes a later step fail for a reason the user did not cause; that failure then reads as ``interrupted``."""
    global _interrupted
    _interrupted = False
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def main(argv: list[str] | None = None) -> int:
    _catch_interrupts()
    try:
        rc = _main(argv)
        sys.stdout.flush()  # what is still buffered meets a closed pipe here, not at exit
        return rc
    except KeyboardInterrupt:  # Ctrl-C at any point, also while the verbs' parsers are built (imports)
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        # the reader of stdout stopped (retrofit ls | head -1): quiet, like any filter whose reader left
        _drop_stdout()
        return 141  # what a shell reports for a process ended by SIGPIPE
    except Exception:
        if _interrupted:  # a Ctrl-C swallowed while the parsers were built (a half-done import) fails later
            print("interrupted", file=sys.stderr)
            return 130
        raise


def _stdout_closed() -> bool:
    """Whether the reading end of stdout's pipe is gone (a write would fail with EPIPE)."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor (a captured stdout): not a pipe
        return False


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's flush at exit does not report the closed pipe again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
            not item.startswith("-") for item in extra):
        # section.key=value after a flag (argparse stops the positionals at the flag); one without its
        # '=value' is the recipe loader's to name, as before a flag
        args.overrides += extra
    elif extra:
        parser.parse_args(argv)  # argparse's own error for what is left
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    from retrofit.fs.tempdirs import Terminated, terminate_on_sigterm

    terminate_on_sigterm()  # SIGTERM unwinds like Ctrl-C: temporary folders and locks are removed
    configure_output(args)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except Exception as exc:  # one clear message, non-zero exit; full trace with RETROFIT_DEBUG=1
        from retrofit.errors import RetrofitError

        if _interrupted:  # Ctrl-C came first and something swallowed it: this failure is its consequence
            print("interrupted", file=sys.stderr)
            return 130
        if _debug():
            raise
        who = error_prefix(args)
        if isinstance(exc, RetrofitError):
            print(f"{who}: error: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            raise  # main: the reader of stdout left, no error
        if isinstance(exc, OSError):
            print(f"{who}: error: {os_error_message(exc)}", file=sys.stderr)
            return 1
        from retrofit.fs.write_errors import write_failure

        failed = write_failure(exc)  # a full disk as torch's zip writer or safetensors reports it
        if failed:
            print(f"{who}: error: {failed}; free disk space or write somewhere else "
                  "(nothing was published: outputs are written to a temporary folder first)", file=sys.stderr)
            return 1
        oom = _out_of_memory(exc)  # a size no check caught (a method's width, a batch): the allocator's refusal
        if oom:
            print(f"{who}: error: out of memory: {oom}; give smaller sizes (a method's widths, lengths, batch) or "
                  "run where more memory is free", file=sys.stderr)
            return 1
        from retrofit.plugins import plugin_failure

        blamed = plugin_failure(exc)  # a plugin's method, backend, family or evaluator raised while it ran
        if blamed:
            print(f"{who}: error: {blamed}", file=sys.stderr)
            return 1
        raise


def _out_of_memory(exc: BaseException) -> str | None:
    """The allocator's refusal in one line (``can't allocate memory: you tried to allocate N bytes``) when ``exc``
    is an out-of-memory error of the CPU or a GPU, else None."""
    if "torch" not in sys.modules and not isinstance(exc, MemoryError):
        return None
    from retrofit.train.memory import is_out_of_memory

    if not is_out_of_memory(exc):
        return None
    import re

    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[enforce fail at [^\]]*\] err == 0\. ", "", line)[:300]


def error_prefix(args: argparse.Namespace) -> str:
    """What an error line starts with: the command as argparse names it in its own errors
    (``retrofit convert``, ``retrofit eval ppl``, ``retrofit bench attention``), so a refusal of a flag's
    value and one found while running read the same."""
    prog = getattr(args, "command_prog", None)
    return prog if isinstance(prog, str) and prog else f"retrofit {args.verb}"


_OS_ADVICE = {
    errno.ENOSPC: "free disk space or write somewhere else",
    errno.EDQUOT: "free disk space or write somewhere else",
    errno.EACCES: "choose a folder you may write to (or fix its permissions)",
    errno.EPERM: "choose a folder you may write to (or fix its permissions)",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.ENOTDIR: "a path component is a file, not a folder: choose another path",
    errno.EISDIR: "the path is a folder where a file is expected",
    errno.EEXIST: "the path exists already: choose another one",
    errno.ENOENT: "check the path",
}


def os_error_message(exc: OSError) -> str:
    """``PATH: what happened; what to do`` for an OSError (disk full, read-only, permissions, ...)."""
    where = exc.filename if exc.filename is not None else ""
    what = exc.strerror or str(exc)
    advice = _OS_ADVICE.get(exc.errno or -1, "check the path and the disk")
    return f"{where}: {what}; {advice}" if where else f"{what}; {advice}"


def _debug() -> bool:
    import os

    return os.environ.get("RETROFIT_DEBUG", "") not in ("", "0")


if __name__ == "__main__":
    sys.exit(main())
