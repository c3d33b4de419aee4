"""The evaluator registry: what ``retrofit eval`` can run, read by the CLI, the suite and the report.

Each evaluator kind (perplexity, harness, passkey, ...) is one module in this package that calls
:func:`register_evaluator` with an :class:`Evaluator`: its name, CLI sub-command, arguments,
how parsed arguments become keyword arguments of its run function, the run function itself
(``"module:function"``, imported only when it runs, so ``retrofit --help`` stays light) and its
report section. The modules here are imported on first use of the registry, so adding a kind is
adding one module; a kind defined elsewhere registers by the same call, imported before use or
named in the ``retrofit.evaluators`` entry-point group (the rule every registry follows:
:mod:`retrofit.plugins`).
"""
from __future__ import annotations

import argparse
import importlib
import re
from dataclasses import dataclass
from typing import Callable

from retrofit.errors import RetrofitError
from retrofit.plugins import Discovery, check_name, import_submodules

__all__ = ["MAX_COUNT", "MAX_NEW_TOKENS", "Evaluator", "check_new_tokens", "count_arg", "evaluators", "get_evaluator", "length_arg", "depth_arg",
           "positive_float_arg", "register_evaluator", "unregister_evaluator"]


@dataclass(frozen=True)
class Evaluator:
    """One evaluator kind.

    name: the section key (``results.json`` ``kind``, ``run_all`` keyword, ``--skip`` value).
    command: the ``retrofit eval COMMAND`` sub-command; subdir: its folder under ``eval all``.
    heading: its section title in ``report.md``; help: the sub-command's one-line help; label: its
    short name in ``eval all``'s help (default: ``name``).
    add_arguments(parser, prefix): its flags; ``prefix`` is ``""`` for its own sub-command and
    ``"<command>-"`` inside ``eval all``, where flags that several kinds share (``--lengths``) take
    it (``--ppl-lengths``). kwargs(args): parsed arguments -> keyword arguments of ``run``.
    run: ``"module:function"`` called as ``fn(model, baseline=..., device=..., dtype=..., out=...,
    command=..., **kwargs)``. check(args): flag checks that must fail before any model loads.
    precheck: ``"module:function"`` called as ``fn(model, tokenizer=..., **kwargs)`` once the models are
    loaded and before ``eval all`` runs its first kind: checks that need the tokenizer (a passkey length its
    instructions do not fit), so they fail before another kind's minutes, not after.
    uses_bos / uses_seed: whether it takes the shared ``--bos`` / ``--seed`` flags.
    reads_text: whether it reads local text (then ``--text-errors`` applies around it).
    order: position in ``eval all`` and in the report.
    """

    name: str
    command: str
    subdir: str
    heading: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser, str], None]
    kwargs: Callable[[argparse.Namespace], dict]
    run: str
    check: Callable[[argparse.Namespace], None] | None = None
    precheck: str | None = None
    uses_bos: bool = False
    uses_seed: bool = False
    reads_text: bool = False
    order: int = 100
    label: str = ""

    def runner(self) -> Callable[..., dict]:
        module, _, fn = self.run.partition(":")
        return getattr(importlib.import_module(module), fn)

    def prechecker(self) -> Callable[..., None] | None:
        if not self.precheck:
            return None
        module, _, fn = self.precheck.partition(":")
        return getattr(importlib.import_module(module), fn)


_REGISTRY: dict[str, Evaluator] = {}
_FOUND = Discovery("retrofit.evaluators", lambda: import_submodules(__name__))  # built-ins: this package's modules


def register_evaluator(ev: Evaluator, *, replace: bool = False) -> Evaluator:
    """Add an evaluator kind. A name already registered (a built-in's included) is a ``RetrofitError``
    unless ``replace=True`` (the rule of every registry: :mod:`retrofit.plugins`); a command another kind
    holds, or ``all``, is one whatever ``replace`` says (``replace`` replaces the kind of that name only)."""
    _FOUND.builtins()
    if "all" in (ev.command, ev.name):
        raise RetrofitError(f"evaluator {ev.name!r}: 'all' is retrofit eval's command that runs every kind; "
                            "choose another command and name")
    for other in _REGISTRY.values():
        if other.name != ev.name and ev.command in (other.command, other.name):
            raise RetrofitError(f"evaluator {ev.name!r}: command {ev.command!r} is taken by {other.name!r}")
    check_name("evaluator", ev.name, _REGISTRY.get(ev.name), ev, replace=replace)
    _REGISTRY[ev.name] = ev
    return ev


def unregister_evaluator(name: str) -> None:
    """Drop a kind (the CLI drops a plugin whose flags clash with its own)."""
    _REGISTRY.pop(name, None)


def evaluators() -> list[Evaluator]:
    """Every registered evaluator kind, in ``order``."""
    _FOUND.everything()
    return sorted(_REGISTRY.values(), key=lambda e: (e.order, e.name))


def get_evaluator(name: str) -> Evaluator:
    _FOUND.everything()
    if name not in _REGISTRY:
        raise RetrofitError(f"unknown evaluator {name!r}: known are {', '.join(e.name for e in evaluators())}")
    return _REGISTRY[name]


# ---------------------------------------------------------------------- argument types shared by kinds
# (the bench suites read their counts and lengths through these too: one rule across the CLI)
_LENGTH_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}
MAX_COUNT = 2**31 - 1  # the most tokens / steps / items any flag takes: beyond it sizes overflow torch's int32 paths
# the most new tokens a generation flag asks for (generate --max-new-tokens, eval's --max-new-tokens, bench decode
# --new-tokens): 1M tokens is hours of decoding even for a small model on a GPU, and past nearly every model's context
MAX_NEW_TOKENS = 1024 * 1024


def check_new_tokens(flag: str, value: int | None) -> None:
    """A count of new tokens above :data:`MAX_NEW_TOKENS` is one error line naming ``flag`` (None: the default)."""
    if value is not None and value > MAX_NEW_TOKENS:
        raise RetrofitError(f"{flag} {value} is more new tokens than one run generates: give at most "
                            f"{MAX_NEW_TOKENS} (1M, already hours of decoding)")


def prefixed_flag(args: argparse.Namespace, flag: str, prefix: str) -> str:
    """``flag`` as the command line spelt it: ``--max-new-tokens`` under ``retrofit eval niah``,
    ``--niah-max-new-tokens`` under ``retrofit eval all`` (``prefix`` ``niah-``)."""
    return f"--{prefix}{flag[2:]}" if getattr(args, "eval_command", None) == "all" else flag


def length_arg(text: str) -> int:
    """'4096', '4K', '4k', '32K', '1M' -> tokens (K = 1024, M = 1024 * 1024), from 2 to :data:`MAX_COUNT`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (use 4096, 4K or 1M)")
    value = float(m.group(1)) * _LENGTH_UNITS[m.group(2).lower()]
    if value != int(value) or value < 2:
        raise argparse.ArgumentTypeError(f"not a whole number of tokens >= 2: {text!r}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text.strip()} tokens is more than any model reads (at most {MAX_COUNT})")
    return int(value)


def count_arg(minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: a whole number from ``minimum`` to :data:`MAX_COUNT` (a count, size or number of tokens)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not minimum <= value <= MAX_COUNT:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give a whole number from {minimum} to "
                                             f"{MAX_COUNT}")
        return value

    parse.__name__ = "int"  # what argparse and --help call the type
    return parse


def positive_float_arg(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, a budget)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def depth_arg(text: str) -> float:
    d = float(text)
    if not 0.0 <= d <= 1.0:
        raise argparse.ArgumentTypeError(f"depth {text} must be in [0, 1]")
    return d
