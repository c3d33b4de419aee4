"""The window base (``retrofit/layers/window.py``): the window methods are built on it and not on each
other, its options are declared once and keep their place in every method's options, its cache
carries no method's state, and on its own it is the pretrained window with sinks, prefilled or
decoded, with the log-sum-exp a method merges another read with."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from retrofit.errors import SpecError
from retrofit.layers import (
    DeltaAttention, DeltaConfig, HedgehogAttention, HedgehogConfig, MacchiatoAttention, MacchiatoConfig,
    MacchiatoLayerCache, WindowAttention, WindowConfig, WindowLayerCache,
)
from retrofit.layers.method import MethodTestSpec, opt, register_method
from retrofit.layers.window import window_config
from retrofit.surgery import convert
from tests.methods._common import batch, pattern_reference, stepwise_logits, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

W = 6
LAYERS = (MacchiatoAttention, DeltaAttention, HedgehogAttention)
CONFIGS = (MacchiatoConfig, DeltaConfig, HedgehogConfig)
WINDOW_OPTIONS = ("window", "sinks", "sink_distance")


def test_the_window_methods_subclass_the_window_and_not_each_other():
    for cls in LAYERS:
        assert cls.__bases__ == (WindowAttention,), cls
        assert not any(issubclass(cls, other) for other in LAYERS if other is not cls), cls
    for cls in CONFIGS:
        assert cls.__bases__ == (WindowConfig,), cls


def test_the_window_options_are_declared_once():
    assert WindowConfig.field_names() == WINDOW_OPTIONS  # chunk_size is each method's own scan
    for cls in CONFIGS:
        for name in WINDOW_OPTIONS:
            assert cls.__dataclass_fields__[name] is WindowConfig.__dataclass_fields__[name], (cls, name)
        assert "chunk_size" not in WindowConfig.__dataclass_fields__ and "chunk_size" in cls.field_names()


def test_each_method_lists_its_options_in_their_former_order():
    """Records, recipes, ``repr`` and the convert flags list the fields as they always did (fields
    added since follow them)."""
    former = {
        MacchiatoConfig: ("window", "latents", "init_swa_share", "conv_size", "sinks", "sink_distance", "chunk_size"),
        DeltaConfig: ("window", "init_swa_share", "memory_half_life", "sinks", "sink_distance", "chunk_size"),
        HedgehogConfig: ("window", "features", "init_log_scale", "memory_distance", "sinks", "sink_distance",
                         "chunk_size"),
    }
    for cls, names in former.items():
        assert cls.field_names()[: len(names)] == names, cls
        config = cls(window=16, sinks=2)
        assert tuple(config.to_dict()) == cls.field_names()
        assert repr(config) == f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in config.to_dict().items())})"
        assert cls(**config.to_dict()) == config


def test_window_config_names_fields_once_and_puts_the_others_after():
    @window_config("gain", "window")
    class _Partial(WindowConfig):
        gain: float = opt(1.0, "gain")
        bias: float = opt(0.0, "bias")

    assert _Partial.field_names() == ("gain", "window", "sinks", "sink_distance", "bias")
    for order in (("window", "window"), ("window", "gian")):
        with pytest.raises(TypeError, match="at most once"):
            @window_config(*order)
            class _Wrong(WindowConfig):
                gain: float = opt(1.0, "gain")


@pytest.mark.parametrize("cls", CONFIGS)
def test_the_window_checks_and_resolution_apply_to_every_method(cls):
    for bad in (dict(window=0), dict(sinks=-1), dict(sink_distance=-1), dict(chunk_size=0)):
        with pytest.raises(SpecError, match=next(iter(bad))):
            cls(**bad)
    model_config = tiny_model("llama").config
    resolved = cls(sinks=2).resolved(model_config, "all")
    assert resolved.window == 128 and resolved.sink_distance == model_config.max_position_embeddings - 1
    assert cls().resolved(model_config, "all").sink_distance is None  # no sinks, no cap recorded


@pytest.mark.parametrize("method, options", [("delta", {}), ("hedgehog", {"features": 8})])
def test_delta_and_hedgehog_have_the_window_cache_and_no_latent_weights(method, options):
    attn = convert(tiny_model("llama"), method=method, window=W, options=options).model.layers[0].self_attn
    assert type(attn.new_cache_layer()) is WindowLayerCache
    assert not hasattr(attn.new_cache_layer(), "conv_tail")
    for name in ("latent_q", "latent_k", "conv", "latents", "latents_per_head"):
        assert not hasattr(attn, name), name
    macchiato = convert(tiny_model("llama"), method="macchiato", window=W, options={"latents": 4})
    entry = macchiato.model.layers[0].self_attn.new_cache_layer()
    assert isinstance(entry, MacchiatoLayerCache) and isinstance(entry, WindowLayerCache)


# ---- the window alone: a method with no state beside it (what a new window method starts from)
@window_config("window", "sinks", "sink_distance")
class _WindowOnlyConfig(WindowConfig):
    method = "window-only-test"
    test_spec = MethodTestSpec(options={"window": W, "sinks": 2}, anchor="closed-window")  # the generic method tests'


class _WindowOnly(WindowAttention):
    method = "window-only-test"


def _build(original, patch, spec, layer_idx, generator):
    c = spec.config
    return _WindowOnly(original, patch, window=c.window, sinks=c.sinks, sink_distance=c.sink_distance)


register_method("window-only-test", _build, config=_WindowOnlyConfig, replace=True)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_window_alone_is_the_window_with_sinks_prefilled_or_decoded(family):
    base = tiny_model(family)
    ref = pattern_reference(base, lambda qr, kr: (kr <= qr) & ((kr > qr - W) | (kr < 2)))
    model = convert(base, method="window-only-test", window=W, options={"sinks": 2})
    assert model.config.retrofit["sinks"] == 2 and model.config.retrofit["window"] == W
    ids, mask, pos = batch(T=25)
    real = mask.bool()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=2e-4)
    full = model(ids, attention_mask=mask).logits.detach()
    for slots in (True, False):
        steps, cache = stepwise_logits(model, ids, mask, prefill=9, slots=slots, chunk_after=15)
        assert all(type(layer) is WindowLayerCache for layer in cache.layers)
        torch.testing.assert_close(steps[real], full[real], atol=2e-5, rtol=2e-5)


def test_the_window_returns_its_log_sum_exp_for_a_merge_in_one_normalisation():
    model = convert(tiny_model("llama"), method="window-only-test", window=W, options={"sinks": 2})
    attn = model.model.layers[0].self_attn
    ids, mask, pos = batch(T=20, left_pad=(0, 3))
    seen = {}
    hook = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos)
    hook.remove()
    x, pe = seen["hidden_states"], seen["position_embeddings"]
    valid = mask.bool()
    with torch.no_grad():
        q, k, v = attn.patch.project_qkv(attn, x, pe)
        out, lse = attn.window_with_lse(q, *attn.window_inputs(q, k, v, valid, None))
        # dense reference: scores over the window's keys and the first 2 real tokens, padding excluded
        H, T = q.shape[1], q.shape[2]
        kk = k.repeat_interleave(H // k.shape[1], dim=1)
        vv = v.repeat_interleave(H // v.shape[1], dim=1)
        s = (q.double() @ kk.double().transpose(-1, -2)) * attn.scaling
        rank = valid.long().cumsum(-1) - 1
        qr, kr = rank[:, :, None], rank[:, None, :]
        allowed = (kr <= qr) & ((kr > qr - W) | (kr < 2)) & valid[:, None, :]
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        want_lse = s.logsumexp(-1)
        want = torch.softmax(s, -1) @ vv.double()
    rows = valid[:, None, :].expand(-1, H, -1)
    torch.testing.assert_close(lse[rows].double(), want_lse[rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.double()[rows], want[rows], atol=1e-4, rtol=1e-4)
    assert dataclasses.is_dataclass(_WindowOnlyConfig) and lse.dtype == torch.float32
