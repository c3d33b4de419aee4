"""lm-eval's own `hf` model on a converted folder: with retrofit imported it evaluates the converted
model (the same metrics as the `retrofit` model), in process and through `retrofit-lm-eval`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from retrofit.eval import harness

TASK = "retrofit_tiny_mc"


@pytest.fixture(autouse=True)
def _reset_accelerate():
    """lm-eval's HFLM builds an accelerate.Accelerator for a path `pretrained`; its process-wide state
    would make a later training test's Accelerator skip DeepSpeed."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _evaluate(model_name: str, model_args: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    import retrofit.eval  # noqa: F401  (registers `retrofit`; `import retrofit` registers the model types)

    lm = get_model(model_name).create_from_arg_string(model_args, {"batch_size": 2, "device": "cpu"})
    res = simple_evaluate(model=lm, tasks=[TASK], limit=6, bootstrap_iters=0,
                          task_manager=harness.task_manager([TASK]))
    return lm, res["results"][TASK]


def test_hf_model_evaluates_the_converted_model(converted_dir):
    hf_lm, hf = _evaluate("hf", f"pretrained={converted_dir},add_bos_token=True")
    assert type(hf_lm.model).__name__ == "RetrofitLlamaForCausalLM"
    _, ours = _evaluate("retrofit", f"pretrained={converted_dir},add_bos_token=True")
    assert hf == ours
    # and the loglikelihoods are the converted model's, not the base's
    import torch

    from retrofit.surgery import load_any

    conv, tok = load_any(str(converted_dir))
    ids = tok("It is a truth universally acknowledged", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(hf_lm.model(ids).logits, conv(ids).logits)


@pytest.mark.slow
def test_retrofit_lm_eval_console_script(converted_dir, tmp_path):
    exe = shutil.which("retrofit-lm-eval", path=str(Path(sys.executable).parent)) or shutil.which("retrofit-lm-eval")
    assert exe, "the retrofit-lm-eval console script is not installed (pip install -e .)"
    out = tmp_path / "out"
    cmd = [exe, "run", "--model", "hf", "--model_args", f"pretrained={converted_dir},add_bos_token=True",
           "--tasks", TASK, "--limit", "6", "--batch_size", "2", "--device", "cpu", "--output_path", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(out.rglob("results_*.json"))
    assert files, proc.stdout[-2000:]
    got = json.loads(files[-1].read_text())["results"][TASK]
    _, want = _evaluate("retrofit", f"pretrained={converted_dir},add_bos_token=True")
    assert got["acc,none"] == want["acc,none"] and got["acc_norm,none"] == want["acc_norm,none"]
