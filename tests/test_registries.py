"""The four registries follow one rule (retrofit/plugins.py): register_<kind> at import, built-ins on
first use, entries of installed distributions through the ``retrofit.<kind>s`` entry-point group, and a
name registered once (a taken one refused unless the call says ``replace=True``).

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


# ---------------------------------------------------------------------- one rule for a taken name
def _method_entry(tag: str):
    def build(original, patch, spec, layer_idx, generator):
        raise NotImplementedError(tag)

    return "test-taken-method", build, tag


def _register_method(entry, **kw):
    name, build, tag = entry
    return method_registry.register_method(name, build, options={"gain": 1.0}, description=tag, **kw)


def _backend_entry(tag: str):
    from retrofit.ops import causal_latte

    return backend_registry.Backend(name="testtaken", priority=-5 if tag == "first" else -6,
                                    kernels={"causal_latte": causal_latte.torch_kernel})


def _family_entry(tag: str):
    return patches.Family(f"test-taken-{tag}", ("test_taken_llama",), "transformers.models.llama.modeling_llama",
                          "LlamaAttention")


def _evaluator_entry(tag: str):
    return ev_registry.Evaluator(name="test-taken", command="test-taken", subdir="t", heading=f"Taken {tag}",
                                 help="registry test entry", add_arguments=lambda parser, prefix: None,
                                 kwargs=lambda args: {}, run="tests.plugins.toy_evaluator:run")


@dataclass(frozen=True)
class Taken:
    entry: Callable[[str], object]  # tag -> an entry under the registry's one test name
    register: Callable[..., object]  # (entry, **kw) -> the registration call
    held: Callable[[], object]  # what the registry holds under that name now
    forget: Callable[[], None]


TAKEN = {
    "method": Taken(_method_entry, _register_method,
                    lambda: method_registry.registered_method("test-taken-method").description,
                    lambda: method_registry._METHODS.pop("test-taken-method", None)),
    "backend": Taken(_backend_entry, backend_registry.register_backend,
                     lambda: backend_registry.get_backend("testtaken").priority,
                     lambda: backend_registry.unregister_backend("testtaken")),
    "family": Taken(_family_entry, patches.register_family,
                    lambda: patches.supported_model_types()["test_taken_llama"],
                    lambda: patches._REGISTRY.pop("test_taken_llama", None)),
    "evaluator": Taken(_evaluator_entry, ev_registry.register_evaluator,
                       lambda: ev_registry.get_evaluator("test-taken").heading,
                       lambda: ev_registry._REGISTRY.pop("test-taken", None)),
}


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_a_taken_name_is_refused_unless_the_call_says_replace(name):
    from retrofit.errors import RetrofitError

    t = TAKEN[name]
    t.forget()
    try:
        t.register(t.entry("first"))
        first = t.held()
        with pytest.raises(RetrofitError, match="already registered.*pass replace=True"):
            t.register(t.entry("second"))
        assert t.held() == first  # the refused call changed nothing
        t.register(t.entry("second"), replace=True)
        assert t.held() != first
        t.register(t.entry("second"))  # the same definition again (a module run twice): no clash
    finally:
        t.forget()


def test_a_plugin_cannot_take_a_built_in_name_without_saying_replace():
    from retrofit.errors import RetrofitError

    torch_backend = backend_registry.get_backend("torch")
    with pytest.raises(RetrofitError, match="backend 'torch' is already registered"):
        backend_registry.register_backend(backend_registry.Backend(name="torch", priority=99, kernels={}))
    assert backend_registry.get_backend("torch") is torch_backend
    llama = patches.get_patch(types.SimpleNamespace(model_type="llama"))
    with pytest.raises(RetrofitError, match="model_type 'llama' is already registered \\(by family 'llama'\\)"):
        patches.register_family(patches.Family("mine", ("mine_llama", "llama"), "m", "A"))
    assert "mine_llama" not in patches.supported_model_types()  # all or nothing
    assert patches.get_patch(types.SimpleNamespace(model_type="llama")) is llama


@pytest.fixture
def registries_restored():
    """The four registries as they are now, put back after the test."""
    held = [dict(method_registry._METHODS), dict(backend_registry._backends), dict(patches._REGISTRY),
            dict(ev_registry._REGISTRY)]
    yield
    for registry, before in zip((method_registry._METHODS, backend_registry._backends, patches._REGISTRY,
                                 ev_registry._REGISTRY), held):
        registry.clear()
        registry.update(before)
    backend_registry.is_installed.cache_clear()
    backend_registry._resolved.clear()


def test_a_module_run_again_registers_its_entries_again_without_a_clash(registries_restored, monkeypatch):
    """A built-in module imported a second time (under another name, or reloaded) makes new objects from
    the same definitions: its registrations go through, holding the new objects."""
    import importlib.util

    copies = {}
    for module in ("retrofit.layers.exp_linear", "retrofit.ops.backends.pytorch", "retrofit.eval.evaluators.passkey",
                   "retrofit.patches.families"):
        importlib.import_module(module)  # the first copy, registered as a built-in
        name = "second_copy_of_" + module.replace(".", "_")
        spec = importlib.util.spec_from_file_location(name, importlib.util.find_spec(module).origin)
        copies[module] = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, copies[module])
        spec.loader.exec_module(copies[module])
    for row in copies["retrofit.patches.families"].FAMILIES:  # the table's rows: registered by the registry itself
        patches.register_family(row)
    assert method_registry.get_method("exp-linear").config is copies["retrofit.layers.exp_linear"].ExpLinearConfig
    assert backend_registry.get_backend("torch") is copies["retrofit.ops.backends.pytorch"].BACKEND
    assert ev_registry.get_evaluator("passkey") is copies["retrofit.eval.evaluators.passkey"].EVALUATOR
    assert patches.get_patch(types.SimpleNamespace(model_type="llama")).row in copies["retrofit.patches.families"].FAMILIES


def test_a_patch_that_cached_its_helpers_is_still_the_same_definition():
    """A family's patch fills private caches as it is used (its RoPE function): a second registration of the
    same row by a module imported again is not a clash after a model was converted."""
    from retrofit.patches.families import FAMILIES

    row = next(r for r in FAMILIES if "llama" in r.model_types)
    used, fresh = row.patch(), row.patch()
    used.__dict__["_rotary_fn"] = object()
    assert plugins.same_definition(used, fresh)
    other = next(r for r in FAMILIES if "llama" not in r.model_types)
    assert not plugins.same_definition(used, other.patch())
