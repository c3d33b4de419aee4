"""Report assembly, formatting helpers, and the `retrofit eval` command line end to end."""
from __future__ import annotations

import json
import math

import pytest

from retrofit.cli.main import main
from retrofit.eval import report


def test_formatting_helpers(tmp_path):
    assert [report.fmt_length(n) for n in (1024, 1536, 4096, 32768, 1000, 64)] == ["1K", "1.5K", "4K", "32K", "1000", "64"]
    assert report.fmt_num(None) == "-" and report.fmt_num(float("inf")) == "inf" and report.fmt_num(3.14159) == "3.14"
    table = report.markdown_table(["a", "b"], [["x", "1"]])
    assert table.splitlines() == ["| a | b |", "| :--- | ---: |", "| x | 1 |"]
    p = report.write_json(tmp_path / "r.json", {"x": float("inf"), "y": [1.5, float("nan")]})
    assert json.loads(p.read_text()) == {"x": "inf", "y": [1.5, "nan"]}
    assert not list(tmp_path.glob(".r.json*"))  # no temp files left behind


def test_write_report_reads_sections_from_subfolders(tmp_path):
    for kind, sub in (("perplexity", "ppl"), ("passkey", "passkey")):
        report.write_json(tmp_path / sub / "results.json",
                          {"kind": kind, "table": f"| {kind} |", "images": [f"{sub}.png"], "description": "d"})
    rep = report.write_report(tmp_path, title="T")
    md = (tmp_path / "report.md").read_text()
    assert rep["sections"] == ["passkey", "perplexity"]
    assert md.index("## Long-context perplexity") < md.index("## Passkey retrieval")
    assert "![ppl](ppl/ppl.png)" in md and "![passkey](passkey/passkey.png)" in md


def test_cli_length_parsing():
    import argparse

    from retrofit.eval.evaluators import length_arg

    assert length_arg("4K") == 4096 and length_arg("1.5k") == 1536 and length_arg("300") == 300
    with pytest.raises(argparse.ArgumentTypeError):
        length_arg("lots")


def test_cli_ppl(converted_dir, base_dir, tmp_path, capsys):
    out = tmp_path / "ppl"
    rc = main(["eval", "ppl", str(converted_dir), "--baseline", str(base_dir), "--lengths", "64", "96",
               "--datasets", "pg-books-heldout", "--max-windows", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| pg-books-heldout |" in printed and "tiny-base + macchiato (2/2 layers, w 16, L 8), untrained 96" in printed
    data = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(data["results"]["pg-books-heldout"][L][r]["ppl"])
               for L in ("64", "96") for r in ("model", "baseline"))


def test_cli_all_writes_one_report(converted_dir, base_dir, tmp_path, capsys):
    out = tmp_path / "all"
    rc = main([
        "eval", "all", str(converted_dir), "--baseline", str(base_dir), "--out", str(out), "--quiet",
        "--ppl-lengths", "64", "--datasets", "pg-books", "--max-windows", "1",
        "--tasks", "retrofit_tiny_mc", "--limit", "3", "--bootstrap-iters", "0",
        "--passkey-lengths", "256", "--depths", "0", "1", "--trials", "1",
        "--niah-lengths", "400", "--niah-depths", "0.5", "--niah-max-new-tokens", "4",
        "--ruler-lengths", "600", "--ruler-tasks", "niah_single_1,ruler_fwe", "--ruler-samples", "1",
        "--ruler-max-new-tokens", "4", "--chat-template", "off",
    ])
    assert rc == 0
    md = (out / "report.md").read_text()
    for heading in ("## Long-context perplexity", "## Few-shot benchmarks (lm-eval)", "## Passkey retrieval",
                    "## Needle in a haystack", "## RULER-style retrieval"):
        assert heading in md
    assert "![niah](niah/niah.png)" in md and "![ruler](ruler/ruler.png)" in md
    for sub in ("niah", "ruler"):
        assert json.loads((out / sub / "results.json").read_text())["settings"]["chat_template"] is False
    assert "![perplexity](ppl/perplexity.png)" in md and "![passkey](passkey/passkey.png)" in md
    for sub in ("ppl", "harness", "passkey"):
        assert (out / sub / "results.json").is_file() and (out / sub / "table.md").is_file()
    assert (out / "ppl" / "perplexity.png").is_file() and (out / "passkey" / "passkey.png").is_file()
    assert "tiny-base + macchiato (2/2 layers, w 16, L 8), untrained vs tiny-base" in capsys.readouterr().out


def test_cli_errors_are_one_line(base_dir, tmp_path, capsys):
    rc = main(["eval", "ppl", str(base_dir), "--datasets", "no-such-corpus", "--out", str(tmp_path), "--quiet"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "unknown dataset 'no-such-corpus'" in err and "Traceback" not in err
