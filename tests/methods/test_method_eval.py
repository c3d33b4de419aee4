"""An lm-eval run (retrofit.eval.run_harness) on the offline tiny tasks, from a saved LLP checkpoint
folder. Perplexity full and chunked through each method's cache: tests/methods/test_every_method.py."""
from __future__ import annotations

import pytest

from retrofit.surgery import convert, save
from tests.eval.tiny import tiny_llama, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_lm_eval_harness_on_a_saved_llp_checkpoint(tokenizer, tmp_path):
    from retrofit.eval import run_harness

    model = convert(tiny_llama(len(tokenizer)), method="llp", options={"segment": 32})
    save(model, tmp_path / "llp", tokenizer=tokenizer)
    res = run_harness(str(tmp_path / "llp"), tasks=["retrofit_tiny_mc"], num_fewshot=0, limit=4, bootstrap_iters=0)
    entry = res["results"]["retrofit_tiny_mc"]["model"]
    assert entry["primary"] is not None and 0.0 <= entry["primary"] <= 100.0
    assert entry["samples"] is not None
