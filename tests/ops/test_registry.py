"""The backend registry: priority order, fallbacks with reasons, forced backends, every op through it,
and every registered method's attention through the dispatched ops.

Fake backends are registered here (and removed after each test) with the torch kernels wrapped
in call counters, so which backend ran is observed, not inferred from the log.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import logging
import pkgutil
from pathlib import Path

import pytest
import torch

import retrofit.ops as ops
from retrofit.errors import SpecError
from retrofit.layers import RetrofitCache, available_methods, get_method
from retrofit.layers.tier import set_tier
from retrofit.ops import backends, dispatched
from retrofit.ops.backends import Backend, Kernel, registry
from retrofit.surgery import ConversionSpec, convert
from retrofit.surgery.distill import converted_modules
from tests.methods._common import batch, tiny_model
from tests.ops._inputs import latte_inputs, padding_mask

LOGGER = "retrofit.ops.backends"


@pytest.fixture(autouse=True)
def _clean_dispatch_state(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.set_default_backend(None)
    backends._reset_log_memory()
    added: list[str] = []
    yield added
    for name in added:
        backends.unregister_backend(name)
    backends.set_default_backend(None)
    backends._reset_log_memory()


def _fake(added: list[str], name: str, priority: int, ops_: tuple[str, ...], **decl) -> dict[str, int]:
    """Register backend ``name`` running the torch kernels of ``ops_``; returns its call counts."""
    calls = {op: 0 for op in ops_}

    def counted(op):
        kernel = backends.get_backend("torch").kernel(op).fn

        def run(*args, **kwargs):
            calls[op] += 1
            return kernel(*args, **kwargs)

        return run

    backends.register_backend(Backend(name=name, priority=priority, kernels={op: counted(op) for op in ops_}, **decl))
    added.append(name)
    return calls


def _latte():
    return latte_inputs(2, 2, 12, 3, 4, dtype=torch.float32)


# --------------------------------------------------------------------------------------
# priority order and fallbacks


def test_auto_takes_the_highest_priority_backend_that_can_run_the_call(_clean_dispatch_state, caplog):
    added = _clean_dispatch_state
    lo = _fake(added, "lo", 30, ("causal_latte_chunked",))
    hi = _fake(added, "hi", 50, ("causal_latte_chunked",), dtypes=frozenset({torch.float32}))
    assert backends.backend_names()[:2] == ("hi", "lo") and backends.backend_names()[-1] == "torch"
    q, k, v = _latte()
    want = ops.causal_latte_chunked(q, k, v, backend="torch")[0]
    torch.testing.assert_close(ops.causal_latte_chunked(q, k, v)[0], want)
    assert (hi["causal_latte_chunked"], lo["causal_latte_chunked"]) == (1, 0)

    # fp64 is not among hi's dtypes: auto skips it (DEBUG, with the reason) and takes lo
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    ops.causal_latte_chunked(q.double(), k.double(), v.double())
    assert (hi["causal_latte_chunked"], lo["causal_latte_chunked"]) == (1, 1)
    skip = [r.getMessage() for r in caplog.records if "not using hi" in r.getMessage()]
    assert len(skip) == 1 and "hi kernels take float32, not torch.float64" in skip[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    backends.unregister_backend("hi")
    backends.unregister_backend("lo")
    assert backends.resolve_backend("causal_latte_chunked", "cpu", torch.float32) == "torch"


def test_choices_are_remembered_until_a_request_or_the_registry_changes(_clean_dispatch_state, monkeypatch):
    """Decoding calls each op per layer per token: the choice is made once per (op, call, request),
    and made again when the process request, RETROFIT_BACKEND or the registered backends change."""
    added = _clean_dispatch_state
    q, k, v = _latte()
    choose = registry._resolve
    made = []
    monkeypatch.setattr(registry, "_resolve", lambda *a: (made.append(a[0]), choose(*a))[1])
    for _ in range(3):
        ops.causal_latte_chunked(q, k, v)
    assert made == ["causal_latte_chunked"]
    counts = _fake(added, "fast", 90, ("causal_latte_chunked",))  # a new backend: chosen afresh, and runs
    ops.causal_latte_chunked(q, k, v)
    assert counts["causal_latte_chunked"] == 1 and len(made) == 2
    with backends.use_backend("torch"):
        ops.causal_latte_chunked(q, k, v)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    ops.causal_latte_chunked(q, k, v)
    assert counts["causal_latte_chunked"] == 1 and len(made) == 4  # both requests chose torch, each afresh
    monkeypatch.delenv(backends.ENV_VAR)
    ops.causal_latte_chunked(q, k, v)
    assert counts["causal_latte_chunked"] == 2 and len(made) == 4  # back to the remembered choice


def test_request_only_kernels_and_dtypes_need_a_request(_clean_dispatch_state):
    step = backends.get_backend("torch").kernel("causal_latte_step").fn
    chunked = backends.get_backend("torch").kernel("causal_latte_chunked").fn
    backends.register_backend(Backend(
        name="shy", priority=50,
        kernels={"causal_latte_step": Kernel(step, auto=False), "causal_latte_chunked": chunked},
        auto_dtypes=frozenset({torch.bfloat16}), auto_dtype_note="test",
    ))
    _clean_dispatch_state.append("shy")
    assert backends.resolve_backend("causal_latte_step", "cpu", torch.bfloat16) == "torch"  # request-only kernel
    assert backends.resolve_backend("causal_latte_step", "cpu", torch.float32, "shy") == "shy"
    assert backends.resolve_backend("causal_latte_chunked", "cpu", torch.bfloat16) == "shy"
    assert backends.resolve_backend("causal_latte_chunked", "cpu", torch.float32) == "torch"  # not an auto dtype
    assert backends.resolve_backend("causal_latte_chunked", "cpu", torch.float32, "shy") == "shy"


def test_requested_backend_that_cannot_run_the_call_falls_back_with_the_reason(_clean_dispatch_state, caplog):
    added = _clean_dispatch_state
    gpu = _fake(added, "gpu", 50, ("causal_latte_chunked",), devices=frozenset({"cuda"}))
    half = _fake(added, "half", 40, ("causal_latte_chunked",), dtypes=frozenset({torch.bfloat16}))
    q, k, v = _latte()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for _ in range(2):  # the warning is given once
        out, _ = ops.causal_latte_chunked(q, k, v, backend="gpu")
        ops.causal_latte_chunked(q, k, v, backend="half")
    torch.testing.assert_close(out, ops.causal_latte_chunked(q, k, v, backend="torch")[0])
    assert gpu["causal_latte_chunked"] == half["causal_latte_chunked"] == 0
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msgs == [
        "retrofit.ops: causal_latte_chunked requested the gpu backend but gpu needs CUDA tensors (got cpu); using torch",
        "retrofit.ops: causal_latte_chunked requested the half backend but half kernels take bfloat16, not "
        "torch.float32; using torch",
    ]


def test_strict_requests_raise_instead_of_falling_back(_clean_dispatch_state, monkeypatch):
    """What the CUDA tests rely on: a named backend whose package does not import is an error
    naming the pip extra, not a quiet run of the torch kernel compared with itself."""
    added = _clean_dispatch_state
    ghost = _fake(added, "ghost", 50, ("causal_latte_chunked",), package="retrofit_no_such_package",
                  install_hint="ghost-kernels")
    q, k, v = _latte()
    with backends.strict_backends():
        with pytest.raises(backends.BackendUnavailable) as err:
            ops.causal_latte_chunked(q, k, v, backend="ghost")
        msg = str(err.value)
        assert "\n" not in msg and "requested the ghost backend but ghost is not installed" in msg
        assert "pip install 'retrofit[gpu]' or ghost-kernels" in msg
        ops.causal_latte_chunked(q, k, v)  # auto is unaffected: it never names a backend
    assert isinstance(err.value, SpecError)
    ops.causal_latte_chunked(q, k, v, backend="ghost")  # not strict: falls back (with a warning)
    monkeypatch.setenv(backends.STRICT_ENV_VAR, "1")
    with pytest.raises(backends.BackendUnavailable):  # the remembered fallback is not reused
        ops.causal_latte_chunked(q, k, v, backend="ghost")
    assert ghost["causal_latte_chunked"] == 0
    monkeypatch.setenv(backends.STRICT_ENV_VAR, "0")
    assert backends.resolve_backend("causal_latte_chunked", "cpu", torch.float32, "ghost") == "torch"


def test_feature_checks_rule_a_backend_out(_clean_dispatch_state):
    added = _clean_dispatch_state
    nopad = _fake(added, "nopad", 50, ("sliding_window_attention",),
                  check=lambda op, call: "no padding" if call.key_padding_mask else None)
    q = torch.randn(2, 2, 9, 4)
    ops.sliding_window_attention(q, q, q, 3)
    ops.sliding_window_attention(q, q, q, 3, key_padding_mask=padding_mask(2, 9, [0, 2]))
    assert nopad["sliding_window_attention"] == 1


def test_forcing_an_unknown_backend_is_one_clear_error(monkeypatch, _clean_dispatch_state):
    _fake(_clean_dispatch_state, "mine", 5, ("causal_latte_chunked",))
    q, k, v = _latte()
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    with pytest.raises(SpecError) as err:
        ops.causal_latte_chunked(q, k, v)
    msg = str(err.value)
    assert "\n" not in msg and "unknown attention backend 'triton'" in msg and "RETROFIT_BACKEND" in msg
    assert "mine" in msg and "fla" in msg and "torch" in msg  # names every registered backend
    with pytest.raises(SpecError, match="unknown attention backend 'nope'"):
        ops.lavo_attention(q, q, q, torch.eye(3)[None], window=4, backend="nope")


def test_info_line_once_per_op_backend_device_dtype(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    q, k, v = _latte()
    for _ in range(3):
        ops.causal_latte_chunked(q, k, v)
    ops.causal_latte_chunked(q.double(), k.double(), v.double())
    ops.exp_linear_attention(q, k, v)
    ran = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert ran == [
        "retrofit.ops: causal_latte_chunked runs on the torch backend (cpu, float32)",
        "retrofit.ops: causal_latte_chunked runs on the torch backend (cpu, float64)",
        "retrofit.ops: exp_linear_attention runs on the torch backend (cpu, float32)",
    ]


def test_bad_backend_names_are_refused():
    for name in ("auto", "A", "x,y", ""):
        with pytest.raises(ValueError, match="bad backend name"):
            backends.register_backend(Backend(name=name, priority=1, kernels={}))


# --------------------------------------------------------------------------------------
# every op goes through the registry


# --------------------------------------------------------------------------------------
# every method's attention goes through dispatched ops

FAMILY = "gemma2"  # soft-capping, a sliding layer and a global one, GQA
METHODS = available_methods()  # at collection: the built-ins and any method registered by then


def _recorder(added: list[str]) -> list[str]:
    """Register backend ``recorder``, above every other, running the torch kernel of every declared
    op; returns the list of the ops it ran, in order."""
    ran: list[str] = []

    def recorded(op):
        def run(*args, **kwargs):
            ran.append(op.name)
            return op.torch_kernel(*args, **kwargs)

        return run

    backends.register_backend(Backend(name="recorder", priority=10_000,
                                      kernels={op.name: recorded(op) for op in dispatched.OPS}))
    added.append("recorder")
    return ran


@contextlib.contextmanager
def _ops_per_layer(model, ran: list[str]):
    """``{layer index: [ops its attention ran]}``, filled by hooks on each converted attention while inside."""
    per_layer: dict[int, list[str]] = {}
    hooks = []
    for m in converted_modules(model):
        i = int(m.layer_idx)
        hooks.append(m.register_forward_pre_hook(lambda mod, args, i=i: per_layer.__setitem__(i, len(ran))))
        hooks.append(m.register_forward_hook(lambda mod, args, out, i=i: per_layer.__setitem__(i, ran[per_layer[i]:])))
    try:
        yield per_layer
    finally:
        for h in hooks:
            h.remove()


def _assert_every_layer_dispatched(model, per_layer: dict[int, list[str]], what: str) -> None:
    layers = {int(m.layer_idx) for m in converted_modules(model)}
    assert layers and set(per_layer) == layers, f"{what}: not every converted layer ran"
    bare = sorted(i for i, ran in per_layer.items() if not ran)
    assert not bare, f"{what}: layer(s) {bare} ran no dispatched op (their attention bypasses the backends)"


def _convert(name: str, model):
    return convert(model, ConversionSpec(method=name, **dict(get_method(name).test_spec.options)))


def _forward(model, ids, mask, pos):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


def _decode_step(model, ids, mask, ran: list[str]) -> dict[int, list[str]]:
    """A prefill of all but the last token through a fresh cache, then the last token alone: the ops
    each layer ran in that one-token step."""
    cache = RetrofitCache(model)
    with torch.no_grad():
        model(ids[:, :-1], attention_mask=mask[:, :-1], past_key_values=cache, use_cache=True)
        with _ops_per_layer(model, ran) as per_layer:
            model(ids[:, -1:], attention_mask=mask, past_key_values=cache, use_cache=True)
    return per_layer


@pytest.mark.parametrize("name", METHODS)
def test_every_methods_attention_runs_through_dispatched_ops(name, _clean_dispatch_state, monkeypatch, one_thread):
    """With a backend above every other that records what it runs, each converted layer of every
    registered method runs at least one dispatched op in a forward and in a one-token cached decoding
    step (through the slots and the general path where the layers have slots); with
    ``RETROFIT_BACKEND=torch`` the recorder is passed over and the same kernels give the same logits."""
    spec = get_method(name).test_spec
    if "convert" in spec.lacks:
        pytest.skip(f"{name} lacks convert: {spec.lacks['convert']}")
    ran = _recorder(_clean_dispatch_state)
    model = _convert(name, tiny_model(FAMILY))
    ids, mask, pos = batch(T=20)
    with _ops_per_layer(model, ran) as per_layer:
        logits = _forward(model, ids, mask, pos)
    _assert_every_layer_dispatched(model, per_layer, f"{name} forward")
    if "decode" not in spec.lacks:
        slotted = [m for m in model.modules() if hasattr(m, "slot_decoding")]
        for slots in ([True, False] if slotted else [None]):
            for m in slotted:
                m.slot_decoding = slots
            _assert_every_layer_dispatched(model, _decode_step(model, ids, mask, ran), f"{name} decode (slots={slots})")
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    ran.clear()
    again = _forward(model, ids, mask, pos)
    assert ran == [] and torch.equal(again, logits)


def test_hedgehog_with_an_exact_tier_runs_the_dispatched_tiered_attention(_clean_dispatch_state, one_thread):
    """The tier's path (set_tier) is not the method's default one: its op is dispatched too."""
    ran = _recorder(_clean_dispatch_state)
    model = _convert("hedgehog", tiny_model(FAMILY))
    assert set_tier(model, 4, block=4) == model.config.num_hidden_layers
    ids, mask, pos = batch(T=20)
    with _ops_per_layer(model, ran) as per_layer:
        _forward(model, ids, mask, pos)
    assert all("tiered_attention" in ops_ for ops_ in per_layer.values()) and per_layer
    assert all("tiered_attention" in ops_ for ops_ in _decode_step(model, ids, mask, ran).values())


# Names a layer may import from a math module (``retrofit.ops.<module>``) instead of from ``retrofit.ops``:
# none is attention math a backend would replace (those are the dispatched ops, imported from retrofit.ops).
LAYER_DIRECT_IMPORTS = {
    "retrofit.ops.hedgehog": {
        "HedgehogState",  # the read's state dataclass, what the dispatched read takes and returns
        "hedgehog_features",  # the learned per-token feature map phi(x) (no token mixing) the read is given
    },
    "retrofit.ops.exact_tier": {
        "RETRIEVE_SCORES",  # the names of block retrieval's rankings (a constant set_tier checks against)
        "TIER_RULES",  # the names of the tier's scoring rules (a constant set_tier checks against)
        "TierState",  # the tier's state dataclass, what the dispatched tiered_attention takes and returns
    },
    "retrofit.ops.rope": {"rope_at", "rope_move", "rope_rotate", "rope_unrotate"},  # RoPE rotations of q / k
    "retrofit.ops.sinks": {"first_valid"},  # picks the first n real tokens as sinks: indexing, no attention
}


def test_layers_import_attention_kernels_only_as_dispatched_ops():
    """No module under retrofit/layers imports from a math module of retrofit.ops beyond the allow-list
    above, the allow-list names no dispatched op (and nothing no layer imports), and every name of a
    declared op a layer module holds is the dispatched op itself."""
    import retrofit.layers

    root = Path(retrofit.layers.__file__).parent
    found: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                direct = [a.name for a in node.names if a.name.startswith("retrofit.ops.")]
                assert not direct, f"{path.name}:{node.lineno} imports {direct}: import the ops from retrofit.ops"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("retrofit.ops."):
                for alias in node.names:
                    assert alias.name in LAYER_DIRECT_IMPORTS.get(node.module, ()), (
                        f"{path.name}:{node.lineno} imports {alias.name} from {node.module}: an attention kernel is "
                        "a dispatched op (declare it in retrofit/ops/dispatched.py, import it from retrofit.ops); "
                        "a helper that is not attention math goes on LAYER_DIRECT_IMPORTS with why")
                    found.add((node.module, alias.name))
    allowed = {(m, n) for m, names in LAYER_DIRECT_IMPORTS.items() for n in names}
    assert found == allowed, f"allow-listed but imported by no layer: {sorted(allowed - found)}"
    declared = {op.name: op for op in dispatched.OPS}
    assert not {n for _, n in allowed} & set(declared)
    modules = [importlib.import_module(f"retrofit.layers.{m.name}") for m in pkgutil.iter_modules(retrofit.layers.__path__)]
    held = [(mod.__name__, n) for mod in modules for n, v in vars(mod).items() if n in declared]
    assert len(held) >= 10  # the layers hold the ops they call
    for module, n in held:
        assert getattr(importlib.import_module(module), n) is declared[n], f"{module}.{n} is not the dispatched op"


@pytest.mark.parametrize("backend", [None, "torch"])
def test_macchiato_dispatches_both_branches(_clean_dispatch_state, backend):
    fake = _fake(_clean_dispatch_state, "fast", 50, ("sliding_window_attention", "causal_latte_chunked", "causal_latte_step"))
    B, Hq, Hkv, T, d, L = 2, 4, 2, 20, 8, 3
    q, k, v = torch.randn(B, Hq, T, d), torch.randn(B, Hkv, T, d), torch.randn(B, Hkv, T, d)
    mix, lat = torch.randn(B, Hq, T, L + 1), torch.randn(B, Hq, T, L)
    out, _ = ops.macchiato_attention(q, k, v, mix, lat, window=8, backend=backend)
    n = 0 if backend == "torch" else 1
    assert fake == {"sliding_window_attention": n, "causal_latte_chunked": n, "causal_latte_step": 0}
    torch.testing.assert_close(out, ops.macchiato_attention_reference(q, k, v, mix, lat, window=8))


def test_every_declared_op_is_dispatched_run_by_torch_and_exported_and_nothing_else():
    """The declarations in retrofit/ops/dispatched.py drive the dispatch table, the torch backend and the exports."""
    from retrofit.ops import dispatched

    declared = {op.name: op for op in dispatched.OPS}
    assert len(declared) == len(dispatched.OPS) >= 16  # one declaration per name
    # the declaration names the op: the module attribute, the registry key and the export agree
    assert {n: v for n, v in vars(dispatched).items() if isinstance(v, registry.Op)} == declared
    assert set(dispatched.__all__) == {"OPS", *declared}
    exported = {n for n in ops.__all__ if isinstance(getattr(ops, n), registry.Op)}
    assert exported == set(declared) and all(getattr(ops, n) is declared[n] for n in exported)
    torch_backend = backends.get_backend("torch")
    assert set(torch_backend.kernels) == set(declared)  # the torch backend runs every op, and nothing else
    for name, op in declared.items():
        assert torch_backend.kernel(name).fn is op.torch_kernel and op.torch_kernel.__name__ == name
        assert op.kernel("torch") is op.torch_kernel
        sig = inspect.signature(op)
        assert sig.parameters["backend"].default == "auto" and op.__doc__
    # no other backend has a kernel for an op that is not declared
    for b in backends.backend_names():
        assert set(backends.get_backend(b).kernels) <= set(declared), b


def test_every_backend_module_registers():
    modules = [m.name for m in pkgutil.iter_modules(backends.__path__) if m.name != "registry"]
    registered = {importlib.import_module(f"retrofit.ops.backends.{m}").BACKEND.name for m in modules}
    assert registered == set(backends.backend_names()) == {"torch", "fla", "flash", "flex"}


def test_a_first_dispatch_inside_torch_compile_traces_and_the_next_eager_call_logs_it(caplog):
    """The choice made while dynamo traces (fullgraph: no logging call allowed there) is logged by the
    next eager call, and the traced op gives the eager result (dynamo's eager backend: no compiler)."""
    q, k, v = _latte()[:3]
    state = ops.LatteState.empty(2, 2, 3, 4)
    step = torch.compile(lambda: ops.causal_latte_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state)[0],
                         fullgraph=True, backend="eager")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = step()
        assert "causal_latte_step" not in caplog.text
        ref = ops.causal_latte_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state)[0]
        assert "causal_latte_step runs on the torch backend" in caplog.text
    torch.testing.assert_close(out, ref)
