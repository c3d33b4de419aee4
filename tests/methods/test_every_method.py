"""Every registered conversion method through one set of checks (the way PEFT's common tester runs
every adapter type), on tiny models with each method's own ``test_spec`` (a
:class:`~retrofit.layers.method.MethodTestSpec` on its config: the options that make it meaningful
at that size, its exactness anchor, the checks it cannot take and why):

* convert: the method's layers replace every attention, its new weights (only those) train;
* anchor: the exactness property it declares (``closed-window``: with the new path closed, the
  pretrained model with a window and sinks, whatever the new weights hold; ``segment-mask``: the
  pretrained model under LLP's mask);
* checkpoint / delta_checkpoint / hf_load: ``save`` -> ``load``, ``save_delta`` -> ``load_delta`` and
  ``transformers.AutoModelForCausalLM.from_pretrained`` of the saved folder give the logits of the
  model they came from, its new weights perturbed ("trained");
* decode: a prefill, single steps and a 5-token chunk through the method's cache (the decoding slots
  and the general path, where the layers have slots) equal one forward, with left padding;
* perplexity: ``retrofit.eval.run_perplexity`` in one forward and chunked through the cache agree;
* generate: greedy ``generate`` is the argmax of the forward over what it generated.

The methods are those registered when this module is collected (:func:`methods_under_test`):
the built-ins, entry-point plugins, this module's toy below and any method a test module collected
earlier registered at import. A method's ``test_spec.lacks`` entry skips a check with its reason.
"""
from __future__ import annotations

import math

import pytest
import torch

from retrofit.layers import MethodTestSpec, WindowAttention, WindowConfig, available_methods, get_method
from retrofit.layers.method import TEST_CHECKS, register_method
from retrofit.layers.window import window_config
from retrofit.surgery import ConversionSpec, convert, load, load_delta, new_parameter_names, save, save_delta
from tests.methods._common import batch, pattern_reference, perturb_new_weights, stepwise_logits, tiny_model


# ---------------------------------------------------------------------- a method from a test module
# The extension path (docs/extending.md): a window method defined and registered here, with the spec
# a new method declares; nothing else is edited and it takes every check below.
@window_config("window", "sinks", "sink_distance")
class _WindowToyConfig(WindowConfig):
    method = "every-method-window-toy"
    test_spec = MethodTestSpec(options={"window": 5, "sinks": 1}, anchor="closed-window")


class _WindowToy(WindowAttention):
    method = "every-method-window-toy"


def _build_window_toy(original, patch, spec, layer_idx, generator):
    c = spec.config
    return _WindowToy(original, patch, window=c.window, sinks=c.sinks, sink_distance=c.sink_distance)


register_method("every-method-window-toy", _build_window_toy, config=_WindowToyConfig,
                description="test: the window alone", replace=True)


# ---------------------------------------------------------------------- the parametrisation
def methods_under_test() -> list[tuple[str, MethodTestSpec]]:
    """``(name, test spec)`` of every method registered now (a config without a spec: the defaults)."""
    return [(name, get_method(name).test_spec) for name in available_methods()]


METHODS = [name for name, _ in methods_under_test()]  # evaluated once, at collection
FAMILY = "gemma2"  # soft-capping, a sliding layer and a global one, GQA


def _spec(name: str) -> MethodTestSpec:
    return get_method(name).test_spec


def _needs(name: str, check: str) -> MethodTestSpec:
    """The method's spec, or a skip with the reason it declares for lacking ``check``."""
    spec = _spec(name)
    if check in spec.lacks:
        pytest.skip(f"{name} lacks {check}: {spec.lacks[check]}")
    return spec


def _convert(name: str, model, **kw):
    return convert(model, ConversionSpec(method=name, **dict(_spec(name).options)), **kw)


def _forward(model, ids, mask, pos) -> torch.Tensor:
    """Logits of one forward with no cache (the layers' cacheless path)."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per method, once: a converted gemma2 with perturbed new weights, its logits on a padded batch,
    and its full and delta checkpoint folders."""
    made: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in made:
            folder = tmp_path_factory.mktemp(f"every-{name}")
            tiny_model(FAMILY).save_pretrained(folder / "base")
            model = _convert(name, tiny_model(FAMILY), base_model=str(folder / "base"))
            perturb_new_weights(model)
            ids, mask, pos = batch(T=20)
            made[name] = dict(model=model, inputs=(ids, mask, pos), logits=_forward(model, ids, mask, pos),
                              full=save(model, folder / "full"), delta=folder / "delta")
            save_delta(model, folder / "delta", base_model=str(folder / "base"))
        return made[name]

    return get


@pytest.fixture(scope="module")
def tokenizer():
    from tests.eval.tiny import train_tokenizer

    return train_tokenizer()


# ---------------------------------------------------------------------- the checks
def test_every_registered_method_is_under_test_with_a_valid_spec():
    builtins = [n for n in METHODS if get_method(n).config.__module__.startswith("retrofit.layers.")]
    assert len(builtins) >= 6 and "every-method-window-toy" in METHODS
    for name, spec in methods_under_test():
        config = get_method(name).config
        if name in builtins:  # every built-in declares its own spec: its tiny options, its anchor or why none
            assert "test_spec" in vars(config), f"{name}: {config.__name__} declares no test_spec"
            assert spec.anchor is not None or "anchor" in spec.lacks, f"{name}: neither an anchor nor why none"
        ConversionSpec(method=name, **dict(spec.options))  # its options are its config's keys, valid
        assert set(spec.lacks) <= set(TEST_CHECKS) and all(spec.lacks.values())


def test_a_method_registered_from_a_test_module_is_collected():
    """A toy registered here, after this module's collection, is in the collection function's list
    with its declared spec, and a method with no spec is there with the defaults'."""
    from retrofit.layers import method as registry

    spec = MethodTestSpec(options={"window": 4}, lacks={"perplexity": "a toy"})
    Toy = window_config("window", "sinks", "sink_distance")(
        type("_LateToyConfig", (WindowConfig,), {"method": "every-method-late-toy", "test_spec": spec,
                                                 "__module__": __name__}))
    try:
        register_method("every-method-late-toy", _build_window_toy, config=Toy, replace=True)
        register_method("every-method-bare-toy", _build_window_toy, options={"gain": 1.0}, replace=True)
        found = dict(methods_under_test())
        assert found["every-method-late-toy"] is spec
        assert found["every-method-bare-toy"] == MethodTestSpec()
        assert "every-method-window-toy" in METHODS  # this module's toy, registered at import
    finally:
        registry._METHODS.pop("every-method-late-toy", None)
        registry._METHODS.pop("every-method-bare-toy", None)
    assert "every-method-late-toy" not in dict(methods_under_test())


@pytest.mark.parametrize("name", METHODS)
def test_convert(name):
    _needs(name, "convert")
    base = tiny_model(FAMILY)
    keys_before = set(base.state_dict())
    model = _convert(name, base)
    layers = [layer.self_attn for layer in model.model.layers]
    assert all(getattr(a, "is_retrofit_attention", False) and a.method == name for a in layers)
    assert model.config.retrofit["method"] == name
    new = new_parameter_names(model)
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(new)
    assert set(model.state_dict()) == keys_before | set(new)
    ids, mask, pos = batch(T=20)
    assert torch.isfinite(_forward(model, ids, mask, pos)[mask.bool()]).all()


def _window_with_sinks(window: int, sinks: int):
    return lambda qr, kr: (kr <= qr) & ((kr > qr - window) | (kr < sinks))


def _segment_mask(segment: int):
    h = segment // 2
    return lambda qr, kr: (kr <= qr) & (torch.div(kr, h, rounding_mode="floor") >= torch.div(qr, h, rounding_mode="floor") - 1)


@pytest.mark.parametrize("name", METHODS)
def test_anchor(name):
    from retrofit.surgery.probe import closed_latent_path

    spec = _needs(name, "anchor")
    if spec.anchor is None:
        pytest.skip(f"{name} declares no exactness anchor (its config's test_spec.anchor)")
    base = tiny_model("qwen2")
    model = _convert(name, tiny_model("qwen2"))
    options = model.config.retrofit
    ids, mask, pos = batch(T=25)
    real = mask.bool()
    if spec.anchor == "closed-window":
        ref = pattern_reference(base, _window_with_sinks(options["window"], options.get("sinks", 0)))
        perturb_new_weights(model)  # closed, whatever the new weights hold
        with closed_latent_path(model) as closed:
            got = _forward(model, ids, mask, pos)
        assert closed == len(model.model.layers)
        want = _forward(ref, ids, mask, pos)
        torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=2e-4)
        if new_parameter_names(model):  # open, the new path counts
            assert not torch.allclose(_forward(model, ids, mask, pos)[real], want[real], atol=1e-2)
    elif spec.anchor == "segment-mask":
        ref = pattern_reference(base, _segment_mask(options["segment"]))
        got, want = _forward(model, ids, mask, pos), _forward(ref, ids, mask, pos)
        torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=2e-4)
    else:  # MethodTestSpec refuses other names; a new anchor needs its reference here
        pytest.fail(f"no reference for anchor {spec.anchor!r}")


@pytest.mark.parametrize("name", METHODS)
def test_checkpoint(name, saved):
    _needs(name, "checkpoint")
    s = saved(name)
    loaded = load(s["full"])
    assert loaded.config.retrofit == s["model"].config.retrofit
    torch.testing.assert_close(_forward(loaded, *s["inputs"]), s["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", METHODS)
def test_delta_checkpoint(name, saved):
    _needs(name, "delta_checkpoint")
    s = saved(name)
    loaded, _ = load_delta(s["delta"])
    assert loaded.config.retrofit["method"] == name
    torch.testing.assert_close(_forward(loaded, *s["inputs"]), s["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", METHODS)
def test_hf_load(name, saved):
    from transformers import AutoModelForCausalLM

    _needs(name, "hf_load")
    s = saved(name)
    loaded = AutoModelForCausalLM.from_pretrained(s["full"])
    assert type(loaded) is type(s["model"])
    torch.testing.assert_close(_forward(loaded.eval(), *s["inputs"]), s["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", FAMILY])
@pytest.mark.parametrize("name", METHODS)
def test_decode(name, family):
    _needs(name, "decode")
    model = _convert(name, tiny_model(family))
    perturb_new_weights(model, scale=0.3)
    ids, mask, _ = batch(T=32, left_pad=(0, 4))
    mask[0, 26] = 0  # a padded token while decoding
    real = mask.bool()
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, use_cache=False).logits
    paths = [True, False] if any(hasattr(m, "slot_decoding") for m in model.modules()) else [True]
    for slots in paths:
        got, _ = stepwise_logits(model, ids, mask, prefill=9, slots=slots, chunk_after=20)
        torch.testing.assert_close(got[real], whole[real], rtol=1e-4, atol=1e-4, msg=lambda m: f"slots={slots}: {m}")


@pytest.mark.parametrize("name", METHODS)
def test_perplexity(name, tokenizer):
    from retrofit.eval import run_perplexity
    from tests.eval.tiny import tiny_llama

    _needs(name, "perplexity")
    model = _convert(name, tiny_llama(len(tokenizer)))
    perturb_new_weights(model, scale=0.3)
    kw = dict(tokenizer=tokenizer, datasets=["pg-books"], lengths=[40, 72], max_windows=1, progress=False)
    full = run_perplexity(model, **kw)
    chunked = run_perplexity(model, chunk_size=16, **kw)  # 16 tokens at a time through the cache
    for L in ("40", "72"):
        ppl = full["results"]["pg-books"][L]["model"]["ppl"]
        assert ppl is not None and math.isfinite(ppl) and ppl > 1.0
        assert chunked["results"]["pg-books"][L]["model"]["ppl"] == pytest.approx(ppl, rel=1e-4)


@pytest.mark.parametrize("name", METHODS)
def test_generate(name):
    _needs(name, "generate")
    model = _convert(name, tiny_model(FAMILY))
    perturb_new_weights(model, scale=0.3)
    ids, mask, _ = batch(T=12, left_pad=(0, 3))
    n = 5
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 12 + n)
    full_mask = torch.cat([mask, torch.ones(2, n, dtype=mask.dtype)], 1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    logits = _forward(model, out, full_mask, pos)
    assert torch.equal(logits[:, 11:-1].argmax(-1), out[:, 12:])
