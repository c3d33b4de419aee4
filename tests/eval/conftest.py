"""Session fixtures for the eval tests: a trained tiny tokenizer, a tiny Llama saved to disk and
its Latte-Macchiato conversion (retrofit.convert), all offline and built once."""
from __future__ import annotations

import pytest

from .tiny import save, tiny_llama, train_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory, tokenizer):
    return save(tiny_llama(len(tokenizer)), tokenizer, tmp_path_factory.mktemp("eval") / "tiny-base")


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory, base_dir, tokenizer):
    import retrofit
    from retrofit.surgery import load_any, save as save_converted

    model, _ = load_any(str(base_dir))
    retrofit.convert(model, retrofit.ConversionSpec(method="macchiato", window=16, latents=8))
    out = tmp_path_factory.mktemp("eval") / "tiny-macchiato"
    save_converted(model, out, tokenizer=tokenizer)
    return out
