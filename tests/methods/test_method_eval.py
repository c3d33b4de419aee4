"""LAVO / LLP / the delta-rule memory through the eval harness (retrofit.eval): perplexity beside the base model on the
local pg-books, scored in one forward and chunk by chunk through the method's cache (the two
must agree), and an lm-eval run on the offline tiny tasks, from a saved checkpoint folder."""
from __future__ import annotations

import math

import pytest

from retrofit.surgery import convert, save
from tests.eval.tiny import tiny_llama, train_tokenizer

SPECS = {
    "lavo": dict(method="lavo", window=16, options={"bases": 8}),
    "llp": dict(method="llp", options={"segment": 32}),
    "delta": dict(method="delta", window=16, options={"sinks": 2, "init_swa_share": 0.6, "chunk_size": 8}),
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_perplexity_sweep_full_and_chunked_agree(name, tokenizer, tmp_path):
    from retrofit.eval import run_perplexity

    base = tiny_llama(len(tokenizer))
    model = convert(tiny_llama(len(tokenizer)), **SPECS[name])
    kw = dict(tokenizer=tokenizer, datasets=["pg-books"], lengths=[64, 160], max_windows=2, progress=False)
    res = run_perplexity(model, baseline=base, baseline_tokenizer=tokenizer, out=tmp_path / "ppl", **kw)
    chunked = run_perplexity(model, chunk_size=24, **kw)  # prefill 24 tokens at a time through the cache
    for L in ("64", "160"):
        cell = res["results"]["pg-books"][L]
        ppl = cell["model"]["ppl"]
        assert ppl is not None and math.isfinite(ppl) and 1.0 < ppl < 10 * len(tokenizer)
        assert cell["baseline"]["ppl"] is not None
        assert chunked["results"]["pg-books"][L]["model"]["ppl"] == pytest.approx(ppl, rel=1e-4)
    assert res["models"]["model"]["converted"]
    assert (tmp_path / "ppl" / "results.json").is_file() and (tmp_path / "ppl" / "perplexity.png").is_file()


def test_lm_eval_harness_on_a_saved_llp_checkpoint(tokenizer, tmp_path):
    from retrofit.eval import run_harness

    model = convert(tiny_llama(len(tokenizer)), **SPECS["llp"])
    save(model, tmp_path / "llp", tokenizer=tokenizer)
    res = run_harness(str(tmp_path / "llp"), tasks=["retrofit_tiny_mc"], num_fewshot=0, limit=4, bootstrap_iters=0)
    entry = res["results"]["retrofit_tiny_mc"]["model"]
    assert entry["primary"] is not None and 0.0 <= entry["primary"] <= 100.0
    assert entry["samples"] is not None
