"""The four registries follow one rule (retrofit/plugins.py): register_<kind> at import, built-ins on
first use, entries of installed distributions through the ``retrofit.<kind>s`` entry-point group.

Each kind has a toy entry in ``tests/plugins/``: registered by importing its module (the call), and
found by a lookup alone when its module is named in the entry-point group (nothing imports it).
"""
from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass
from importlib import metadata
from typing import Callable

import pytest
import torch

from retrofit import patches, plugins
from retrofit.eval import evaluators as ev_registry
from retrofit.layers import method as method_registry
from retrofit.ops.backends import registry as backend_registry


@dataclass(frozen=True)
class Kind:
    group: str
    found: plugins.Discovery
    module: str
    is_found: Callable[[], bool]
    forget: Callable[[], None]


def _forget_method() -> None:
    method_registry._METHODS.pop("toy-plugin-method", None)


def _forget_family() -> None:
    patches._REGISTRY.pop("toy_plugin_llama", None)


def _forget_evaluator() -> None:
    ev_registry._REGISTRY.pop("toy-plugin-eval", None)


def _family_found() -> bool:
    config = types.SimpleNamespace(model_type="toy_plugin_llama")
    return "toy_plugin_llama" in patches.supported_model_types() and patches.get_patch(config).family == "toy-plugin-family"


def _backend_found() -> bool:
    if "toyplugin" not in backend_registry.backend_names():
        return False
    return backend_registry.resolve_backend("causal_latte", "cpu", torch.float32, "toyplugin") == "toyplugin"


KINDS = {
    "method": Kind("retrofit.methods", method_registry._FOUND, "tests.plugins.toy_method",
                   lambda: "toy-plugin-method" in method_registry.available_methods(), _forget_method),
    "backend": Kind("retrofit.backends", backend_registry._FOUND, "tests.plugins.toy_backend",
                    _backend_found, lambda: backend_registry.unregister_backend("toyplugin")),
    "family": Kind("retrofit.families", patches._FOUND, "tests.plugins.toy_family", _family_found, _forget_family),
    "evaluator": Kind("retrofit.evaluators", ev_registry._FOUND, "tests.plugins.toy_evaluator",
                      lambda: "toy-plugin-eval" in [e.name for e in ev_registry.evaluators()], _forget_evaluator),
}


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    k = KINDS[request.param]
    k.found.everything()  # the built-ins and real plugins first, as in any run
    k.forget()
    sys.modules.pop(k.module, None)
    assert not k.is_found()
    yield k
    k.forget()
    sys.modules.pop(k.module, None)


def test_the_four_registries_share_one_discovery_rule():
    assert {k.group for k in KINDS.values()} == {"retrofit.methods", "retrofit.backends", "retrofit.families",
                                                 "retrofit.evaluators"}
    for k in KINDS.values():
        assert isinstance(k.found, plugins.Discovery) and k.found.group == k.group
    for name in ("register_method", "register_backend", "register_family", "register_evaluator"):
        assert name in plugins.__doc__


def test_an_entry_registered_by_the_call_is_found(kind):
    importlib.import_module(kind.module)  # its module calls register_<kind> once, at import
    assert kind.is_found()


def test_an_entry_named_in_the_entry_point_group_is_found_by_a_lookup(kind, monkeypatch):
    def entry_points(*, group: str):
        return [metadata.EntryPoint(name="toy", value=kind.module, group=group)] if group == kind.group else []

    monkeypatch.setattr(plugins.metadata, "entry_points", entry_points)
    monkeypatch.setattr(kind.found, "_done", kind.found._done - {"entry points"})  # a fresh process's state
    assert kind.module not in sys.modules
    assert kind.is_found()  # the lookup imported the module named in the group
    assert kind.module in sys.modules


def test_the_built_ins_come_first_and_a_broken_plugin_only_warns(monkeypatch):
    order: list[str] = []
    found = plugins.Discovery("retrofit.toys", lambda: order.append("builtins"))

    def entry_points(*, group: str):
        assert group == "retrofit.toys"
        return [metadata.EntryPoint(name="broken", value="tests.plugins.no_such_module", group=group)]

    monkeypatch.setattr(plugins.metadata, "entry_points", entry_points)
    found.builtins()  # what a registration runs: the built-ins only
    assert order == ["builtins"]
    with pytest.warns(RuntimeWarning, match="retrofit.toys entry point 'broken'"):
        found.everything()
    found.everything()  # once per process
    assert order == ["builtins"]
