"""retrofit.eval: long-context perplexity, lm-eval few-shot benchmarks, passkey retrieval, reports.

Python API (each returns a JSON-friendly result dict and, given ``out=``, writes
``results.json``, ``table.md`` and PNGs there)::

    from retrofit.eval import run_perplexity, run_harness, run_passkey, write_report

    ppl = run_perplexity("runs/gemma-macchiato", baseline="gemma3-270m",
                         datasets=["pg-books"], lengths=[1024, 2048, 4096], out="runs/eval/ppl")
    keys = run_passkey("runs/gemma-macchiato", lengths=[1024, 4096], depths=[0, 0.5, 1.0],
                       out="runs/eval/passkey")
    lm = run_harness("runs/gemma-macchiato", tasks=["hellaswag", "piqa"], out="runs/eval/harness")
    write_report("runs/eval", {"perplexity": ppl, "passkey": keys, "harness": lm})

Importing this package also registers the lm-eval model ``retrofit`` (at once if lm-eval is
already imported, else right after its import, so importing retrofit.eval - which the CLI does for
the evaluator registry - never imports lm-eval itself; ``RetrofitLM`` loads only when that model is
requested), so ``lm_eval.simple_evaluate(model="retrofit",
model_args="pretrained=DIR")`` works, and ``python -m retrofit.eval.lm_eval_cli run --model
retrofit ...`` runs the lm-eval CLI with it.
"""
from __future__ import annotations

__all__ = [
    "run_perplexity",
    "run_passkey",
    "run_harness",
    "run_all",
    "write_report",
    "load_model",
    "PAPER_FEWSHOT",
    "register_lm_eval_model",
]

_LAZY = {
    "run_perplexity": "retrofit.eval.perplexity",
    "run_passkey": "retrofit.eval.passkey",
    "run_harness": "retrofit.eval.harness",
    "PAPER_FEWSHOT": "retrofit.eval.harness",
    "run_all": "retrofit.eval.suite",
    "write_report": "retrofit.eval.report",
    "load_model": "retrofit.eval.loading",
}

LM_EVAL_MODEL_NAME = "retrofit"


def register_lm_eval_model() -> bool:
    """Register ``retrofit`` in lm-eval's model registry as a lazy placeholder.

    Returns False when lm-eval is not installed. Idempotent.
    """
    try:
        import lm_eval.models  # noqa: F401  (fills the registry first: lm-eval only lazy-loads an empty one)
        from lm_eval.api.registry import model_registry
    except ImportError:
        return False
    target = "retrofit.eval.lm_model:RetrofitLM"
    if LM_EVAL_MODEL_NAME not in model_registry:
        model_registry.register(LM_EVAL_MODEL_NAME, target=target)
    return True


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'retrofit.eval' has no attribute {name!r}")


from retrofit._hooks import when_imported  # noqa: E402

when_imported("lm_eval", register_lm_eval_model)
del when_imported
