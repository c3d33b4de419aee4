"""Every public class in retrofit/layers documents its arguments (and, for modules, what a call
returns) with shapes, and carries one short example that runs as written (doctest)."""
from __future__ import annotations

import doctest
import importlib
import inspect

import pytest
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

MODULES = ["base", "cache", "conv", "exp_linear", "lavo", "llp", "macchiato", "window"]

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _public_classes(name: str) -> list[type]:
    mod = importlib.import_module(f"retrofit.layers.{name}")
    objs = [getattr(mod, n) for n in mod.__all__]
    return [c for c in objs if inspect.isclass(c) and c.__module__ == mod.__name__
            and issubclass(c, (nn.Module, CacheLayerMixin, Cache))]


def test_every_public_layer_class_has_args_returns_and_an_example():
    classes = [c for name in MODULES for c in _public_classes(name)]
    assert len(classes) >= 11  # 4 attention layers + base, conv, LAVO's parameters, 4 cache entries + the cache
    for cls in classes:
        doc = inspect.getdoc(cls) or ""
        assert "Args:" in doc and ">>> " in doc, cls.__name__
        if issubclass(cls, nn.Module) and cls.forward is not nn.Module.forward:  # a module that is called
            assert "Returns:" in doc and "(B, T" in doc, cls.__name__


@pytest.mark.parametrize("name", MODULES)
def test_examples_run_as_written(name):
    mod = importlib.import_module(f"retrofit.layers.{name}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0 and result.failed == 0, result
