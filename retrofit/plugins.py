"""How retrofit's four registries find what they hold: one rule for all of them.

* conversion methods: ``retrofit.layers.register_method``, group ``retrofit.methods``;
* kernel backends: ``retrofit.ops.backends.register_backend``, group ``retrofit.backends``;
* model families: ``retrofit.patches.register_family``, group ``retrofit.families``;
* evaluator kinds: ``retrofit.eval.evaluators.register_evaluator``, group ``retrofit.evaluators``.

1. An entry registers itself: its module makes the registration call once, at import.
2. The built-ins are registered on first use: the first lookup (``get_*``, the listing
   functions, a dispatched op call) or registration imports them (the method modules of
   ``retrofit.layers``, every module of ``retrofit.ops.backends`` and of
   ``retrofit.eval.evaluators``, the rows of ``retrofit.patches.families``).
3. Installed distributions add theirs without any import on the user's side: the first
   lookup also imports every module named in the registry's entry-point group, e.g. in the
   plugin's ``pyproject.toml``::

       [project.entry-points."retrofit.methods"]
       gain = "my_methods.gain"          # a module whose import calls register_method(...)

4. Anything else registers by the same call: import your module before use.

A registration made after the built-ins replaces a built-in of the same name (methods ask
for ``overwrite=True``). A plugin module that fails to import or register (whatever it raises,
``SystemExit`` included; only Ctrl-C goes through) is reported in one warning line and skipped:
one broken plugin never breaks a verb. :func:`report_broken` is that line, for a registry that
finds a plugin unusable later (an evaluator whose flags clash with the CLI's).
"""
from __future__ import annotations

import importlib
import pkgutil
import threading
import warnings
from importlib import metadata
from typing import Callable

__all__ = ["Discovery", "import_submodules", "report_broken"]


def report_broken(what: str, why: BaseException | str) -> None:
    """One warning line: the plugin ``what`` is skipped, and ``why`` (an exception: its type and message)."""
    if isinstance(why, BaseException):
        why = f"{type(why).__name__}: {why}" if str(why) else type(why).__name__
    # warn_explicit without a source file: the line is printed alone, with no code line under it
    warnings.warn_explicit(f"retrofit: {what} skipped: {why}", RuntimeWarning, filename="retrofit", lineno=0,
                           module="retrofit.plugins")


def import_submodules(package: str) -> None:
    """Import every module of ``package`` whose name does not start with ``_``."""
    pkg = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


class Discovery:
    """The first-use loading of one registry: its built-ins, then its entry-point group.

    ``builtins()``: registers the built-ins. :meth:`builtins` runs it once (what a
    registration calls first, so a later registration comes after the built-ins);
    :meth:`everything` also imports the entry-point group's modules once (what lookups call).
    A call made while either runs (a built-in module registering itself) returns at once.
    """

    def __init__(self, group: str, builtins: Callable[[], None]):
        self.group = group
        self._builtins = builtins
        self._done: set[str] = set()
        self._lock = threading.RLock()

    def builtins(self) -> None:
        self._once("builtins", self._builtins)

    def everything(self) -> None:
        self.builtins()
        self._once("entry points", self._entry_points)

    def _once(self, step: str, fn: Callable[[], None]) -> None:
        if step in self._done:
            return
        with self._lock:
            if step in self._done:
                return
            self._done.add(step)
            fn()

    def _entry_points(self) -> None:
        for ep in sorted(metadata.entry_points(group=self.group), key=lambda e: e.name):
            try:
                ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a broken plugin never breaks retrofit
                report_broken(f"{self.group} entry point {ep.name!r} ({ep.value}) failed to load or register and is",
                              exc)
