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

5. A name is registered once: registering a name that is already taken (a built-in's, a plugin's)
   raises :class:`retrofit.errors.RetrofitError` unless the call passes ``replace=True``, which
   replaces the entry. Registering the same definition again is no clash (its module run a second
   time, unchanged: imported under another name, or reloaded): :func:`check_name` is that rule, for
   all four.

A plugin module that fails to import or register (whatever it raises,
``SystemExit`` included; only Ctrl-C goes through) is reported in one warning line and skipped:
one broken plugin never breaks a verb. :func:`report_broken` is that line, for a registry that
finds a plugin unusable later (an evaluator whose flags clash with the CLI's).

A plugin that raises later, while a verb runs it (a method's builder or layer during ``convert``, a
backend's kernel, an evaluator's run), is one error line naming the plugin and what it raised
(:func:`plugin_failure`, read by the CLI), not a traceback through retrofit's code.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import sys
import threading
import types
import warnings
from importlib import metadata
from typing import Any, Callable, Mapping

from retrofit.errors import RetrofitError

__all__ = ["Discovery", "check_name", "import_submodules", "plugin_failure", "report_broken", "same_definition"]

# the plugin modules the entry-point groups named, once loaded: {module name: "GROUP entry point 'NAME'"}
_LOADED: dict[str, str] = {}


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
            else:
                _LOADED[ep.module] = f"{self.group} entry point {ep.name!r}"


def _package(module: str) -> str:
    return module.split(".", 1)[0]


def _plugin_packages() -> dict[str, list[str]]:
    """``{top-level package: [how it was found]}`` of the plugins in use: the modules the entry-point groups
    loaded, and the packages of conversion methods registered from outside retrofit (imported by a caller)."""
    found: dict[str, list[str]] = {}
    for module, label in _LOADED.items():
        found.setdefault(_package(module), []).append(label)
    methods = sys.modules.get("retrofit.layers.method")  # never imported here: a method in use has loaded it
    for name, info in sorted(getattr(methods, "_METHODS", {}).items()):
        module = getattr(info.builder, "__module__", None) or ""
        if module and _package(module) not in found:
            found[_package(module)] = [f"method {name!r}"]
    found.pop("retrofit", None)
    return found


def plugin_failure(exc: BaseException) -> str | None:
    """What to say when ``exc`` was raised in a plugin's code (its traceback runs through a module of a
    plugin's package): the plugin, the function that raised, the exception's type and message, on one
    line; None when no plugin's code is on the traceback (retrofit's own failure)."""
    packages = _plugin_packages()
    if not packages:
        return None
    blamed = None
    tb = exc.__traceback__
    while tb is not None:  # the frame nearest to the raise wins: that plugin's code raised or called what did
        module = tb.tb_frame.f_globals.get("__name__") or ""
        if isinstance(module, str) and _package(module) in packages:
            code = tb.tb_frame.f_code
            blamed = module, getattr(code, "co_qualname", code.co_name)
        tb = tb.tb_next
    if blamed is None:
        return None
    module, function = blamed
    labels = ", ".join(packages[_package(module)])
    what = " ".join(f"{type(exc).__name__}: {exc}".split()) if str(exc) else type(exc).__name__
    where = f"{module}.{function}()" if function != "<module>" else module
    return (f"the plugin {module} ({labels}) failed in {where}: {what}; fix or update the plugin, or uninstall it "
            "(RETROFIT_DEBUG=1 shows the traceback)")


def check_name(kind: str, name: str, held: Any, new: Any, *, replace: bool, holder: str = "") -> None:
    """The registries' one rule for a taken name: ``RetrofitError`` when ``name`` already holds ``held``,
    unless ``replace`` or ``new`` is the same definition as ``held`` (:func:`same_definition`).

    ``kind`` names the registry's entries in the message (``"method"``, ``"model_type"``, ...);
    ``holder`` says what holds the name now, where the entry's own name does not (a family's model_type).
    """
    if held is None or replace or same_definition(held, new):
        return
    by = f" (by {holder})" if holder else ""
    raise RetrofitError(f"{kind} {name!r} is already registered{by}; pass replace=True to replace it, or register "
                        "under another name")


def _code_site(obj: Any) -> tuple:
    """Where a function or class is defined: the same for every object one definition makes (its module
    run again, under another name or reloaded, makes new objects from the same source)."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code.co_filename, code.co_firstlineno, getattr(obj, "__qualname__", None)
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    return getattr(module, "__file__", None) or obj.__module__, obj.__qualname__


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return _EMPTY


_EMPTY = object()


def _same_class(a: type, b: type, depth: int) -> bool:
    if a is b:
        return True
    if _code_site(a) != _code_site(b):
        return False
    if dataclasses.is_dataclass(a) != dataclasses.is_dataclass(b):
        return False
    if dataclasses.is_dataclass(a):  # classes made at run time (make_dataclass) share a site: compare fields
        fa, fb = dataclasses.fields(a), dataclasses.fields(b)
        return [f.name for f in fa] == [f.name for f in fb] and all(
            same_definition(x.default, y.default, _depth=depth + 1) for x, y in zip(fa, fb))
    return True


def same_definition(a: Any, b: Any, *, _depth: int = 0) -> bool:
    """Whether ``a`` and ``b`` are one registration made twice: equal values, where functions and classes
    are compared by where they are defined (and a function's defaults and closure by value)."""
    if a is b:
        return True
    if _depth > 6:
        return False
    if isinstance(a, type) and isinstance(b, type):
        return _same_class(a, b, _depth)
    if isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType):
        cells = [[_cell(c) for c in f.__closure__ or ()] for f in (a, b)]
        return (_code_site(a) == _code_site(b) and same_definition(a.__defaults__, b.__defaults__, _depth=_depth + 1)
                and same_definition(cells[0], cells[1], _depth=_depth + 1))
    if not _same_class(type(a), type(b), _depth):
        return False
    if dataclasses.is_dataclass(a):
        return all(same_definition(getattr(a, f.name), getattr(b, f.name), _depth=_depth + 1)
                   for f in dataclasses.fields(a))
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(same_definition(a[k], b[k], _depth=_depth + 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_definition(x, y, _depth=_depth + 1) for x, y in zip(a, b))
    if isinstance(a, (str, bytes, int, float, complex, bool, frozenset, set, type(None))):
        return a == b
    if isinstance(a, types.MethodType):
        return a.__self__ is b.__self__ and same_definition(a.__func__, b.__func__, _depth=_depth + 1)
    if isinstance(a, functools.partial):
        return same_definition((a.func, a.args, a.keywords), (b.func, b.args, b.keywords), _depth=_depth + 1)
    if type(a).__eq__ is object.__eq__ and isinstance(getattr(a, "__dict__", None), dict) \
            and not isinstance(a, types.ModuleType):  # a plain object (a family's patch): its public attributes
        public = [{k: x for k, x in vars(o).items() if not k.startswith("_")} for o in (a, b)]  # not its caches
        return same_definition(public[0], public[1], _depth=_depth + 1)
    try:
        return bool(a == b)
    except Exception:  # an == that is no truth value (tensors): not provably the same
        return False
