"""`retrofit eval`."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("eval", help=help_text, description=help_text)
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from retrofit.errors import RetrofitError

    raise RetrofitError("'retrofit eval' is not wired up yet in this build")
