"""Run a registration right after a third-party package is imported (a post-import hook).

``import retrofit`` must stay instant (the CLI's ``--help``), yet a converted folder must load
through ``transformers.AutoModelForCausalLM`` whenever retrofit has been imported. So
``retrofit/__init__`` calls :func:`when_imported`: if the package is already imported the
callback runs at once, otherwise a finder on ``sys.meta_path`` wraps that package's loader and
runs the callback just after the package's own ``__init__`` has executed. A failing callback
warns and never breaks the user's import.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from typing import Any, Callable

__all__ = ["when_imported"]

_CALLBACKS: dict[str, list[Callable[[], Any]]] = {}
_LOCK = threading.RLock()


def _run(name: str) -> None:
    with _LOCK:
        callbacks = _CALLBACKS.pop(name, [])
    for fn in callbacks:
        try:
            fn()
        except Exception as exc:  # never break the user's import
            warnings.warn(f"retrofit: registering with {name} failed: {exc!r}", RuntimeWarning, stacklevel=2)


class _Loader(importlib.abc.Loader):
    def __init__(self, name: str, loader: Any):
        self._name, self._loader = name, loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _run(self._name)

    def __getattr__(self, attr: str) -> Any:  # get_resource_reader, is_package, get_code, ...
        return getattr(self._loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in _CALLBACKS:
            return None
        for finder in sys.meta_path:  # the spec the rest of the import system would find
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(fullname, spec.loader)
        return spec


_FINDER = _Finder()


def when_imported(name: str, callback: Callable[[], Any]) -> None:
    """Call ``callback()`` now if top-level package ``name`` is imported, else right after its import."""
    with _LOCK:
        _CALLBACKS.setdefault(name, []).append(callback)
        if name not in sys.modules and _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    if name in sys.modules:
        _run(name)
