"""A converted folder is its own model type: the Hugging Face tools load the converted model (same
logits as retrofit.load) when retrofit is imported, and plain transformers refuses it."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import retrofit
from retrofit.surgery import ConversionSpec, convert, new_parameter_names, save

from .tiny import FAMILIES, tiny_model, tiny_tokenizer

# every family with one method: each method's folder through AutoModelForCausalLM is
# tests/methods/test_every_method.py's (hf_load)
SPEC = ConversionSpec(window=8, latents=8, conv_size=2)


def _saved(tmp_path, family):
    layers = [1] if family == "gemma2" else "all"  # a partly converted folder loads the same way
    model = convert(tiny_model(family), SPEC, base_model="tiny", layers=layers)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # "trained" new weights, so a dropped latent path would show
        for name in new_parameter_names(model):
            p = dict(model.named_parameters())[name]
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return save(model, tmp_path / family, tokenizer=tiny_tokenizer())


def _ids():
    return torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_classes_and_pipeline_load_the_converted_model(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM, pipeline

    expected_type = "retrofit_" + tiny_model(family).config.model_type  # gemma3 -> retrofit_gemma3_text
    out = _saved(tmp_path, family)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == expected_type
    assert cfg["architectures"][0].startswith("Retrofit") and cfg["architectures"][0].endswith("ForCausalLM")
    ref = retrofit.load(out)
    auto = AutoModelForCausalLM.from_pretrained(out)
    assert type(auto).__name__ == cfg["architectures"][0] == type(ref).__name__
    assert AutoConfig.from_pretrained(out).model_type == expected_type
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, ref(ids).logits)
    # exactly the new weights train, as after retrofit.convert / retrofit.load
    assert {n for n, p in auto.named_parameters() if p.requires_grad} == set(new_parameter_names(auto))

    gen = pipeline("text-generation", model=str(out), device="cpu")
    assert type(gen.model).__name__ == type(ref).__name__
    tok = gen.tokenizer
    prompt = "It is a truth universally acknowledged"
    text = gen(prompt, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    enc = tok(prompt, return_tensors="pt")
    want = ref.generate(**enc, max_new_tokens=8, do_sample=False)[0, enc["input_ids"].shape[1]:]
    assert text == tok.decode(want, skip_special_tokens=True)


def test_legacy_folder_is_migrated_by_retrofit_load(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    out = _saved(tmp_path, "llama")
    ref = retrofit.load(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]  # the format before model_type
    (out / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="retrofit"):
        migrated = retrofit.load(out)
    assert "older retrofit" in caplog.text and "retrofit_llama" not in str(out)
    assert type(migrated).__name__ == "RetrofitLlamaForCausalLM"
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(migrated(ids).logits, ref(ids).logits)
    again = save(migrated, tmp_path / "resaved")
    assert json.loads((again / "config.json").read_text())["model_type"] == "retrofit_llama"
    # what the old format did: plain transformers builds the base (hence the warning)
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "LlamaForCausalLM"


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ""}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_plain_transformers_refuses_and_import_retrofit_fixes_it(tmp_path):
    out = _saved(tmp_path, "gemma3")
    plain = _python(f"""
        import sys
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(out)!r})
        except ValueError as exc:
            print("REFUSED", "retrofit" in sys.modules, exc)
        else:
            print("LOADED")
    """, tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert "REFUSED False" in plain.stdout and "`retrofit_gemma3_text`" in plain.stdout
    # `import retrofit` before transformers: registered by the post-import hook, instantly
    hooked = _python(f"""
        import sys, retrofit
        assert "transformers" not in sys.modules
        from transformers import AutoModelForCausalLM
        print(type(AutoModelForCausalLM.from_pretrained({str(out)!r})).__name__)
    """, tmp_path)
    assert hooked.returncode == 0, hooked.stderr
    assert hooked.stdout.strip().endswith("RetrofitGemma3ForCausalLM")


def test_registration_works_when_transformers_is_imported_by_retrofit_layers(tmp_path):
    """The registration runs right after transformers' import; when a retrofit layer module is what
    imports transformers, it runs while retrofit.layers is half imported and must not need it."""
    run = _python("""
        import sys, warnings
        warnings.simplefilter("error", RuntimeWarning)  # a failed registration only warns
        import retrofit.layers.method
        assert "transformers" in sys.modules
        from transformers import AutoConfig
        print(type(AutoConfig.for_model("retrofit_llama")).__module__)
    """, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "retrofit.surgery.auto_classes"


def test_plain_save_pretrained_keeps_the_identity(tmp_path):
    from transformers import AutoModelForCausalLM

    model = convert(tiny_model("qwen2"), SPEC)
    model.save_pretrained(tmp_path / "plain")  # not retrofit.save: the identity must still be written
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["model_type"] == "retrofit_qwen2"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, model(_ids()).logits)


def test_from_config_builds_the_converted_architecture():
    from transformers import AutoModelForCausalLM

    model = convert(tiny_model("gemma2"), SPEC, layers=[1])  # one layer converted
    fresh = AutoModelForCausalLM.from_config(model.config)
    assert type(fresh) is type(model)
    assert set(fresh.state_dict()) == set(model.state_dict())


def test_converted_classes_build_through_the_builder_the_package_set(monkeypatch):
    """auto_classes does not import convert (no import cycle): the package hands it the builder, and a class
    built without one says so instead of loading a base model under a converted name."""
    from transformers import AutoModelForCausalLM

    from retrofit.surgery import auto_classes
    from retrofit.surgery.convert import build_from_record

    model = convert(tiny_model("llama"), SPEC)
    calls = []
    monkeypatch.setattr(auto_classes, "_BUILDER", lambda m, record: (calls.append(record), build_from_record(m, record)))
    fresh = AutoModelForCausalLM.from_config(model.config)
    assert calls == [model.config.retrofit] and fresh.config.retrofit == model.config.retrofit
    monkeypatch.setattr(auto_classes, "_BUILDER", None)
    with pytest.raises(RuntimeError, match="import retrofit before transformers"):
        AutoModelForCausalLM.from_config(model.config)


def test_assisted_generation_is_refused_before_it_starts():
    from retrofit.errors import RetrofitError

    model = convert(tiny_model("llama"), SPEC)
    ids = _ids()[:1, :10]
    with pytest.raises(RetrofitError, match="assistant_model"):
        model.generate(ids, assistant_model=tiny_model("llama"), max_new_tokens=4)
    with pytest.raises(RetrofitError, match="prompt_lookup_num_tokens"):
        model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=4)
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 12)
