"""The compiled decoder is generic: each attention layer owns its step (retrofit.layers.decoding).

retrofit/decoding/ names no method's layer, buffers, cache or state (checked on the source, as the
import allow-lists of tests/ops/test_registry.py are); a layer defined here, which implements the
interface and is no built-in method, is driven by the decoder as the built-in ones are; a layer
without it is refused with the reason, and a layer's own refusal reaches the caller.
"""
from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import retrofit.decoding
import retrofit.layers
import retrofit.ops
from retrofit.decoding import CompiledDecoder, compiled_decoding_support
from retrofit.errors import RetrofitError
from retrofit.layers import RetrofitAttention, RetrofitLayerCache, WindowAttention, WindowConfig
from retrofit.layers.decoding import CompiledDecodingLayer, DecodingBuffers, supports_compiled_decoding
from retrofit.layers.method import MethodTestSpec, opt, register_method
from retrofit.layers.window import WindowDecodingBuffers, window_config
from retrofit.ops import slot_attention_step
from retrofit.surgery import convert
from tests.decoding.test_compiled import STEPS, WINDOW, _decoder_logits, _prompt, _reference_logits
from tests.surgery.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

# ---- the static check: what retrofit/decoding/ may take from the layers
# Names the decoding package may import from a module of retrofit.layers: the generic interface and
# the cache plumbing every converted model has. Nothing from retrofit.ops: a step's math is its layer's.
DECODING_LAYER_IMPORTS = {
    "retrofit.layers.cache": {"cache_keyword", "output_cache"},  # the cache keyword / the output's cache
    "retrofit.layers.decoding": {"DecodingBuffers", "supports_compiled_decoding"},  # the interface
}
# Generic bases a decoding module may name (in prose or code): no method's own class.
GENERIC = {"RetrofitAttention", "RetrofitLayerCache", "DecodingBuffers", "WindowAttention", "WindowLayerCache",
           "WindowDecodingBuffers"}


def _method_specific_names() -> set[str]:
    """Every layer, cache entry and decoding-buffers class the layers package defines, and every state
    class of retrofit.ops, less the generic bases."""
    names: set[str] = set()
    for info in pkgutil.iter_modules(retrofit.layers.__path__):
        module = importlib.import_module(f"retrofit.layers.{info.name}")
        for name, value in vars(module).items():
            if (isinstance(value, type) and value.__module__ == module.__name__
                    and issubclass(value, (RetrofitAttention, RetrofitLayerCache, DecodingBuffers))):
                names.add(name)
    for info in pkgutil.iter_modules(retrofit.ops.__path__):  # the states live in the math modules
        module = importlib.import_module(f"retrofit.ops.{info.name}")
        names |= {n for n, v in vars(module).items() if isinstance(v, type) and n.endswith("State")}
    return names - GENERIC


def _decoding_sources() -> list[Path]:
    return sorted(Path(retrofit.decoding.__file__).parent.rglob("*.py"))


def test_the_decoding_package_imports_no_method():
    for path in _decoding_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                ours = [a.name for a in node.names if a.name.startswith(("retrofit.layers", "retrofit.ops"))]
                assert not ours, f"{path.name}:{node.lineno} imports {ours}"
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                assert not module.startswith("retrofit.ops"), (
                    f"{path.name}:{node.lineno} imports from {module}: a step's math belongs to its layer")
                if module.startswith("retrofit.layers"):
                    for alias in node.names:
                        assert alias.name in DECODING_LAYER_IMPORTS.get(module, ()), (
                            f"{path.name}:{node.lineno} imports {alias.name} from {module}: the decoder drives "
                            "layers through retrofit.layers.decoding.CompiledDecodingLayer, not by their class")


def test_the_decoding_package_names_no_method_class_or_state():
    forbidden = _method_specific_names()
    assert {"MacchiatoAttention", "DeltaAttention", "HedgehogAttention", "LatteState", "DeltaState",
            "HedgehogState", "MacchiatoLayerCache"} <= forbidden  # the check sees the built-in methods
    for path in _decoding_sources():
        text = path.read_text()
        named = sorted(n for n in forbidden if re.search(rf"\b{n}\b", text))
        assert not named, f"{path.name} names {named}: a method's step and buffers live next to its layer"
        assert "isinstance(attn" not in text  # support is found by the interface


# ---- a layer of this module: the window alone, with a compiled step of its own
@dataclass
class _StepBuffers(WindowDecodingBuffers):
    steps: torch.Tensor  # () long: tokens this layer's step has run (the layer's own state, updated in place)


class _WindowStep(WindowAttention):
    """The window with sinks, plus the compiled-decoding interface (the eager step is the window's)."""

    method = "compiled-step-test"
    refusal: str | None = None  # set on an instance: its compiled_decoding_support reason

    def compiled_decoding_support(self) -> str | None:
        return self.refusal

    def init_decoding_buffers(self, entry: Any) -> _StepBuffers:
        window = self.window_decoding_buffers(entry)
        return _StepBuffers(**window.window_fields(), steps=torch.zeros((), dtype=torch.long))

    def decoding_step(self, buffers: _StepBuffers, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      hidden_states: torch.Tensor, position_embeddings: Any, position: torch.Tensor) -> torch.Tensor:
        allowed = self.decoding_window(buffers, k, v, position)
        buffers.steps.add_(1)
        return slot_attention_step(q, buffers.slot_k, buffers.slot_v, allowed, scaling=self.scaling)


class _WindowNoStep(WindowAttention):
    """The same window without the interface (decoded eagerly only)."""

    method = "compiled-step-test"


@window_config("window", "sinks", "sink_distance", "compiled_step")
class _StepTestConfig(WindowConfig):
    method = "compiled-step-test"
    test_spec = MethodTestSpec(options={"window": 6, "sinks": 2}, anchor="closed-window")  # the generic method tests'
    compiled_step: bool = opt(True, "build the layer with its compiled decoding step")


def _build(original, patch, spec, layer_idx, generator):
    c = spec.config
    cls = _WindowStep if c.compiled_step else _WindowNoStep
    return cls(original, patch, window=c.window, sinks=c.sinks, sink_distance=c.sink_distance)


register_method("compiled-step-test", _build, config=_StepTestConfig, replace=True)


def _model(compiled_step: bool = True, sinks: int = 2):
    base = tiny_model("llama", max_position_embeddings=32)  # STEPS takes the sinks past their RoPE cap
    return convert(base, method="compiled-step-test", window=WINDOW,
                   options={"sinks": sinks, "compiled_step": compiled_step}).eval()


def test_the_interface_is_found_on_the_layer_not_by_its_class():
    model = _model()
    for layer in model.model.layers:
        assert isinstance(layer.self_attn, CompiledDecodingLayer) and supports_compiled_decoding(layer.self_attn)
    assert not supports_compiled_decoding(_model(compiled_step=False).model.layers[0].self_attn)


@pytest.mark.parametrize("sinks", [2, 0])
def test_a_layer_defined_outside_the_package_is_driven_by_the_decoder(sinks):
    model = _model(sinks=sinks)
    assert compiled_decoding_support(model) is None
    prompt = _prompt()
    ref, tokens = _reference_logits(model, prompt, STEPS)
    decoder = CompiledDecoder(model, compile=False)
    got = _decoder_logits(decoder, prompt, tokens)
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=f"token {i}")
    assert all(isinstance(b, _StepBuffers) and int(b.steps) == STEPS for b in decoder.buffers)
    window_only = sum(WindowDecodingBuffers(**b.window_fields()).nbytes() for b in decoder.buffers)
    assert decoder.memory_bytes() == window_only + 8 * len(decoder.buffers)  # the layer's own counters counted


def test_a_layer_without_the_interface_is_refused_with_the_reason():
    model = _model(compiled_step=False)
    reason = compiled_decoding_support(model)
    assert reason is not None and "layer 0" in reason and "_WindowNoStep" in reason
    assert "CompiledDecodingLayer" in reason  # what the layer lacks
    with pytest.raises(RetrofitError, match="compiled decoding step"):
        CompiledDecoder(model, compile=False)


def test_a_layers_own_refusal_reaches_the_caller():
    model = _model()
    model.model.layers[1].self_attn.refusal = "this layer has no step for its configuration"
    assert compiled_decoding_support(model) == "this layer has no step for its configuration"
    with pytest.raises(RetrofitError, match="no step for its configuration"):
        CompiledDecoder(model, compile=False)
