"""A method is one unit (since f39ba40): config dataclass + layer + builder + registration in one module.

Flags and recipe keys derived from the method configs, inapplicable keys as errors, every
default written once, records of pre-release versions refused, and a method defined in this
test module (docs/extending.md's worked example) converting, saving, loading, training one step
and generating with no edit anywhere else.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import retrofit
from retrofit.cli.convert import build_spec, method_flags
from retrofit.cli.main import build_parser, main
from retrofit.errors import CheckpointError, SpecError
from retrofit.layers import (
    DEFAULT_WINDOW, ExpLinearAttention, ExpLinearConfig, LavoAttention, LavoConfig, LLPAttention, LLPConfig,
    MacchiatoAttention, MacchiatoConfig, RetrofitAttention,
)
from retrofit.layers.cache import RetrofitCache, RetrofitLayerCache, cache_keyword
from retrofit.layers.method import MethodConfig, MethodTestSpec, get_method, opt, register_method
from retrofit.layers import available_methods
from retrofit.surgery import ConversionSpec, convert, converted_layers, new_parameter_names, save
from retrofit.surgery.records import spec_from_record
from tests.surgery.tiny import tiny_model

RECORDS = json.loads((Path(__file__).parent / "fixtures" / "records_v0.json").read_text())
BUILTIN = {"macchiato": MacchiatoConfig, "exp-linear": ExpLinearConfig, "lavo": LavoConfig, "llp": LLPConfig}


def _spec_from_argv(*argv: str) -> ConversionSpec:
    args = build_parser().parse_args(["convert", "MODEL", "--out", "OUT", *argv])
    return build_spec(args)


# ---------------------------------------------------------------------- registry and defaults
def test_each_builtin_method_is_registered_by_its_module_with_its_config():
    assert set(BUILTIN) <= set(available_methods())
    for name, cls in BUILTIN.items():
        info = get_method(name)
        assert info.config is cls and cls.method == name
        assert info.builder.__module__ == cls.__module__  # builder and config live together
        assert info.uses == cls.field_names()


@pytest.mark.parametrize("layer,cls,renames", [
    (MacchiatoAttention, MacchiatoConfig, {}),
    (ExpLinearAttention, ExpLinearConfig, {}),
    (LavoAttention, LavoConfig, {}),
    (LLPAttention, LLPConfig, {}),
])
def test_layer_defaults_are_the_config_defaults(layer, cls, renames):
    """Each default is written once: the layer's keyword defaults read the config's."""
    params = inspect.signature(layer.__init__).parameters
    for f in dataclasses.fields(cls):
        if f.name not in params:
            continue
        want = DEFAULT_WINDOW if f.name == "window" else f.default  # window None = DEFAULT_WINDOW (resolved)
        assert params[f.name].default == want, (layer.__name__, f.name)


def test_window_none_resolves_to_the_default_or_the_native_window():
    cfg = tiny_model("gemma3", num_hidden_layers=4,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]).config
    for method in ("macchiato", "lavo"):
        spec = ConversionSpec(method=method)
        assert spec.window is None
        assert spec.resolved(cfg).window == DEFAULT_WINDOW  # layers: all
        assert ConversionSpec(method=method, layers="global").resolved(cfg).window == cfg.sliding_window
        assert ConversionSpec(method=method, layers="global", window=8).resolved(cfg).window == 8


def test_spec_module_imports_no_layer_or_torch_at_top_level():
    src = Path(retrofit.surgery.spec.__file__).read_text()
    top = [n for n in ast.parse(src).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.startswith(("torch", "transformers", "retrofit.layers"))], names
    from retrofit.surgery.spec import DEFAULT_INIT_SWA_SHARE, DEFAULT_WINDOW as W  # still importable, lazily

    assert W == DEFAULT_WINDOW and DEFAULT_INIT_SWA_SHARE == MacchiatoConfig.init_swa_share


# ---------------------------------------------------------------------- recipe keys and flags
def test_recipe_keys_are_the_method_config_fields():
    flat = ConversionSpec.from_dict({"method": "lavo", "window": 16, "bases": 8, "dissect": False})
    nested = ConversionSpec.from_dict({"method": "lavo", "window": 16, "options": {"bases": 8, "dissect": False}})
    assert flat == nested and flat.config == LavoConfig(window=16, bases=8, dissect=False)
    assert flat.to_dict() == {"method": "lavo", **flat.config.to_dict(), "layers": "all", "dtype": None, "seed": 0,
                              "rope_cap": None}
    assert ConversionSpec.from_dict(flat.to_dict()) == flat  # a record / recipe round trip
    with pytest.raises(SpecError, match=r"window \(a key of .*\) does not apply to method 'exp-linear'"):
        ConversionSpec.from_dict({"method": "exp-linear", "window": 8})
    with pytest.raises(SpecError, match="segment .*does not apply to method 'macchiato'"):
        ConversionSpec.from_dict({"method": "macchiato", "segment": 8})
    with pytest.raises(SpecError, match="unknown conversion key.*wndow"):
        ConversionSpec.from_dict({"method": "macchiato", "wndow": 8})
    with pytest.raises(SpecError, match="dissect must be true or false"):
        ConversionSpec(method="lavo", dissect="no")


def test_flags_are_derived_from_every_method_config():
    flags = method_flags()
    for name, cls in BUILTIN.items():
        for f in dataclasses.fields(cls):
            assert flags[f.name]["flag"] == "--" + f.name.replace("_", "-") and name in flags[f.name]["methods"]
    assert _spec_from_argv("--window", "8", "--latents", "16", "--sinks", "2").config == \
        MacchiatoConfig(window=8, latents=16, sinks=2)
    assert _spec_from_argv("--method", "llp", "--segment", "16").config == LLPConfig(segment=16)
    assert _spec_from_argv("--method", "exp-linear", "--chunk-size", "32").config == ExpLinearConfig(chunk_size=32)
    lavo = _spec_from_argv("--method", "lavo", "--no-dissect", "--bases", "8", "--memory-scaling", "none")
    assert lavo.config == LavoConfig(dissect=False, bases=8, memory_scaling=None)


@pytest.mark.parametrize("argv,match", [
    (["--method", "exp-linear", "--window", "8"], "--window do(es) not apply to method 'exp-linear' (its flags: --chunk-size)"),
    (["--segment", "16"], "--segment do(es) not apply to method 'macchiato'"),
    (["--method", "llp", "--latents", "8", "--sinks", "1"], "--latents, --sinks do(es) not apply to method 'llp'"),
    (["--method", "lavo", "--option", "rank=4"], "method 'lavo' has no key(s) rank"),
])
def test_inapplicable_flags_are_one_error_line(argv, match, tmp_path, capsys):
    with pytest.raises(SpecError) as exc:
        _spec_from_argv(*argv)
    assert match in str(exc.value)
    out = tmp_path / "never"
    assert main(["convert", str(tmp_path / "no-model"), "--out", str(out), *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("retrofit convert: error:") and match in err[0]
    assert not out.exists()


def test_flags_from_a_recipe_are_checked_against_its_method(tmp_path):
    recipe = tmp_path / "lavo.yaml"
    recipe.write_text("method: lavo\nwindow: 8\nbases: 4\n")
    assert _spec_from_argv("--config", str(recipe), "--global-weight", "0.25").config == \
        LavoConfig(window=8, bases=4, global_weight=0.25)
    with pytest.raises(SpecError, match="--latents do.es. not apply to method 'lavo'"):
        _spec_from_argv("--config", str(recipe), "--latents", "8")
    with pytest.raises(SpecError, match="bases .*does not apply to method 'macchiato'"):
        _spec_from_argv("--config", str(recipe), "--method", "macchiato")  # the recipe's lavo keys


# ---------------------------------------------------------------------- records of pre-release versions
@pytest.mark.parametrize("name", sorted(RECORDS))
def test_records_written_by_pre_release_versions_are_refused_with_what_to_do(name):
    """The exact config.retrofit dicts pre-release code wrote (tests/surgery/fixtures): never read as specs."""
    with pytest.raises(CheckpointError, match="pre-release retrofit.*convert the base model again"):
        spec_from_record(RECORDS[name]["record"], "old")


def test_a_folder_with_a_pre_release_record_does_not_load(tmp_path):
    model = convert(tiny_model("llama"), ConversionSpec(window=8, latents=8), base_model="tiny/llama")
    save(model, tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["retrofit"] = RECORDS["macchiato"]["record"]  # the same method and sizes, as a pre-release version wrote them
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="its retrofit section is invalid: .*pre-release retrofit"):
        retrofit.load(tmp_path / "m")


# ---------------------------------------------------------------------- a method from outside
# The same toy as docs/extending.md's worked example (there named "gain"): one config, one layer with
# a recurrent state of its own, one builder, one register_method line. Nothing else is edited.
@dataclass
class MeanState:
    total: torch.Tensor  # (B, Hkv, D) sum of the real values so far
    count: torch.Tensor  # (B,) how many


@dataclass
class GainConfig(MethodConfig):
    """A toy method's config: output = o_proj(gain * running mean of v)."""

    method = "gain-test"
    test_spec = MethodTestSpec(options={"gain": 2.0}, lacks={
        "anchor": "a running mean of the values: no attention pattern of the base's to equal"})
    gain: float = opt(1.0, "initial output gain")
    learn_gain: bool = opt(True, "train the gain")

    def check(self) -> None:
        if self.gain <= 0:
            raise SpecError(f"gain must be > 0, got {self.gain}")


class GainAttention(RetrofitAttention):
    method = "gain-test"
    new_module_names = ("gain",)

    def __init__(self, original, patch, *, gain: float = GainConfig.gain):
        super().__init__(original, patch)
        self.gain = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(self.gain.weight, gain)

    def new_cache_layer(self) -> RetrofitLayerCache:
        return RetrofitLayerCache()  # holds a MeanState; no key window

    def attend(self, q, k, v, valid, cache, *, hidden_states, position_embeddings):
        w = torch.ones_like(v[:, 0, :, 0]) if valid is None else valid.to(v.dtype)  # (B, T)
        total, count = (v * w[:, None, :, None]).cumsum(2), w.cumsum(1)
        if cache is not None and cache.state is not None:
            total, count = total + cache.state.total[:, :, None], count + cache.state.count[:, None]
        if cache is not None:
            cache.store(None, None, None, MeanState(total[:, :, -1], count[:, -1]), num_new=v.shape[2])
        mean = total / count.clamp_min(1)[:, None, :, None]
        return (self.gain.weight[0, 0] * mean).repeat_interleave(self.num_heads // self.num_kv_heads, 1)


def build_gain(original, patch, spec, layer_idx, generator):
    return GainAttention(original, patch, gain=spec.config.gain)


register_method("gain-test", build_gain, config=GainConfig, description="test: o_proj(gain * mean of v)", replace=True)


def test_a_method_registered_from_a_test_module_converts_saves_and_loads(tmp_path, capsys):
    assert "gain-test" in available_methods()
    spec = _spec_from_argv("--method", "gain-test", "--gain", "2.5", "--no-learn-gain")  # its flags, derived
    assert spec.config == GainConfig(gain=2.5, learn_gain=False)
    with pytest.raises(SpecError, match="gain must be > 0"):
        ConversionSpec(method="gain-test", gain=0.0)
    with pytest.raises(SpecError, match="--window do.es. not apply to method 'gain-test'"):
        _spec_from_argv("--method", "gain-test", "--window", "8")
    model = convert(tiny_model("llama"), spec)
    assert model.config.retrofit["gain"] == 2.5 and new_parameter_names(model) == [
        "model.layers.0.self_attn.gain.weight", "model.layers.1.self_attn.gain.weight"]
    save(model, tmp_path / "g")
    loaded = retrofit.load(tmp_path / "g")
    assert isinstance(loaded.model.layers[0].self_attn, GainAttention)
    assert loaded.model.layers[0].self_attn.gain.weight.item() == 2.5
    ids = torch.randint(3, 200, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits)


def test_a_method_registered_from_a_test_module_trains_and_generates(tmp_path):
    """convert -> one training step (the training pipeline, new weights only) -> generate with the
    constant-memory cache, which holds the toy's own state and equals decoding without a cache."""
    from retrofit.train import train
    from retrofit.train.recipe import recipe_from_dict
    from tests.train import tiny

    base = tiny.save_base(tmp_path / "base")
    books = tiny.write_books(tmp_path / "books", n=3, chars=4_000)
    recipe = recipe_from_dict(tiny.recipe_dict(
        base, books, tmp_path / "run", conversion={"method": "gain-test", "gain": 2.0},
        train={"max_steps": 1, "lr": 1e-1, "warmup_steps": 0, "gradient_checkpointing": False},
        checkpoint={"save_every": 1}, eval={"sequences": 0},
    ))
    result = train(recipe)
    assert result.counts.trainable == 2  # one gain per converted layer, nothing else
    loaded = retrofit.load(result.final_dir).eval()
    attn = loaded.model.layers[0].self_attn
    assert isinstance(attn, GainAttention) and attn.gain.weight.item() != 2.0  # the step moved it

    ids = torch.randint(3, 200, (2, 7))
    with torch.no_grad():
        cached = loaded.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
        uncached = loaded.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
        cache = RetrofitCache(loaded)
        loaded(cached[:, :-1], **{cache_keyword(loaded.forward): cache}, use_cache=True)
    assert cached.shape == (2, 13) and torch.equal(cached, uncached)
    entry = cache.layers[0]
    assert isinstance(entry.state, MeanState) and entry.state.count.tolist() == [12.0, 12.0]
    assert entry.memory_bytes() == sum(t.numel() * t.element_size() for t in (entry.state.total, entry.state.count))


def test_the_docs_worked_example_is_this_toy(monkeypatch):
    """docs/extending.md's example runs as written and computes what GainAttention above computes."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    block = doc.split("# my_methods/gain.py\n", 1)[1].split("```", 1)[0]
    block = block.replace('method = "gain"', 'method = "gain-docs"').replace('register_method("gain"', 'register_method("gain-docs"')
    module = types.ModuleType("docs_gain")  # dataclasses look their module up in sys.modules
    monkeypatch.setitem(sys.modules, "docs_gain", module)
    exec(compile(block, "docs/extending.md", "exec"), module.__dict__)
    assert get_method("gain-docs").config is module.GainConfig
    ids = torch.randint(3, 200, (2, 9))
    models = [convert(tiny_model("llama"), ConversionSpec(method=m, gain=1.5)).eval() for m in ("gain-docs", "gain-test")]
    with torch.no_grad():
        torch.testing.assert_close(models[0](ids).logits, models[1](ids).logits, rtol=0, atol=0)
