"""BENCHMARKS.md is rendered from benchmarks/ by scripts/render_benchmarks.py: the committed page
must equal a fresh rendering, and each table kind renders the files the CLI verbs write."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "scripts" / "render_benchmarks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rb = _renderer()


def test_committed_page_matches_its_data():
    rendered = rb.render(ROOT / "benchmarks", ROOT)
    committed = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert rendered == committed, "BENCHMARKS.md is stale: run python scripts/render_benchmarks.py"


def test_check_mode(tmp_path, capsys):
    page = tmp_path / "B.md"
    assert rb.main(["--out", str(page)]) == 0
    assert rb.main(["--check", "--out", str(page)]) == 0
    page.write_text(page.read_text() + "edited by hand\n")
    assert rb.main(["--check", "--out", str(page)]) == 1
    assert "stale" in capsys.readouterr().err


def _page(tmp_path: Path, section: str, files: dict[str, dict]) -> Path:
    bench = tmp_path / "benchmarks"
    (bench / "10-x").mkdir(parents=True)
    (bench / "page.yaml").write_text("title: T\n")
    (bench / "10-x" / "section.yaml").write_text(section)
    for name, data in files.items():
        (bench / "10-x" / name).write_text(json.dumps(data))
    return bench


def _ppl(model_label, values, lengths=(1024, 4096), base=(10.0, 11.0)):
    return {"kind": "perplexity", "command": "retrofit eval ppl m --baseline b",
            "models": {"baseline": {"label": "b"}, "model": {"label": model_label}},
            "settings": {"lengths": list(lengths)},
            "results": {"books": {str(L): {"baseline": {"ppl": x}, "model": {"ppl": y}}
                                  for L, x, y in zip(lengths, base, values)}}}


def test_ppl_from_eval_results_with_several_models(tmp_path):
    section = """title: SmolLM2
tables:
  - kind: ppl
    data: [yarn.json, conv.json]
    machine: a machine
    commit: abc1234
    labels: {b: base, "yarn.json:model": base + YaRN, runs/c/final: converted}
    ratio: {model: converted, baseline: base, label: ratio}
"""
    bench = _page(tmp_path, section, {"yarn.json": _ppl("b (rope)", [12.0, None]),
                                      "conv.json": _ppl("runs/c/final", [10.5, 11.0])})
    text = rb.render(bench, tmp_path)
    assert "| dataset | model | 1K | 4K |" in text
    assert "| books | base | 10.00 | 11.00 |" in text
    assert "|  | base + YaRN | 12.00 | - |" in text
    assert "|  | converted | 10.50 | 11.00 |" in text
    assert "|  | ratio | 1.05 | 1.00 |" in text
    assert "retrofit eval ppl m --baseline b" in text  # the command from results.json
    assert "Commit: `abc1234`" in text and "benchmarks/10-x/yarn.json" in text


def test_passkey_and_generic_tables(tmp_path):
    passkey = {"kind": "passkey", "command": "retrofit eval passkey m",
               "models": {"baseline": {"label": "b"}, "model": {"label": "m"}},
               "settings": {"lengths": [4096], "depths": [0, 0.5, 1]},
               "results": {r: {"accuracy": {"4096": {"0": a, "0.5": 0.8, "1": 0.0}}} for r, a in
                           (("baseline", 1.0), ("model", 0.0))}}
    table = {"columns": ["a", "b"], "rows": [["x", "0.070"]], "notes": "A note.", "command": "cmd",
             "machine": "m", "commit": "per row"}
    section = """title: S
question: Why?
tables:
  - {kind: passkey, data: pk.json, machine: m, commit: 1234567}
  - {kind: table, data: t.json}
"""
    text = rb.render(_page(tmp_path, section, {"pk.json": passkey, "t.json": table}), tmp_path)
    assert "| model (depth 0 / 0.5 / 1) | 4K |" in text
    assert "| b | 100 / 80 / 0 |" in text and "| m | 0 / 80 / 0 |" in text
    assert "| x | 0.070 |" in text and "A note." in text and "Commit: per row." in text
    assert "*Why?*" in text and "- [S](#s)" in text


def test_ruler_and_niah_grids_merge_lengths_run_apart(tmp_path):
    def ruler(lengths, scores):
        return {"kind": "ruler", "command": "retrofit eval ruler m",
                "models": {"baseline": {"label": "b"}, "model": {"label": "m"}},
                "settings": {"tasks": ["niah_single_2", "ruler_vt"], "lengths": lengths},
                "results": {r: {"scores": {t: {str(L): v for L in lengths} for t, v in per_task.items()}}
                            for r, per_task in scores.items()}}
    short = ruler([4096], {"baseline": {"niah_single_2": 1.0, "ruler_vt": 0.5},
                           "model": {"niah_single_2": 2 / 3, "ruler_vt": None}})
    long = ruler([32768], {"baseline": {"niah_single_2": 0.0, "ruler_vt": 0.25},
                           "model": {"niah_single_2": 1 / 3, "ruler_vt": 0.0}})
    niah = {"kind": "niah", "command": "retrofit eval niah m",
            "models": {"baseline": {"label": "b"}, "model": {"label": "m"}},
            "settings": {"lengths": [1024, 2048], "depths": [0, 0.5, 1.0]},
            "results": {r: {"score": {"1024": {"0": 1.0, "0.5": 1.0, "1": a},
                                      "2048": {"0": a, "0.5": 0.0, "1": 1.0}}}
                        for r, a in (("baseline", 1.0), ("model", 0.0))}}
    section = """title: S
tables:
  - {kind: ruler, data: [r4.json, r32.json], machine: m, commit: 1234567, labels: {m: conv}}
  - {kind: niah, data: n.json, machine: m, commit: 1234567}
"""
    text = rb.render(_page(tmp_path, section, {"r4.json": short, "r32.json": long, "n.json": niah}), tmp_path)
    assert "| model | task | 4K | 32K |" in text
    assert "| b | niah_single_2 | 100 | 0 |" in text and "|  | ruler_vt | 50 | 25 |" in text
    assert "| conv | niah_single_2 | 67 | 33 |" in text and "|  | ruler_vt | - | 0 |" in text
    assert "|  | mean | 75 | 12 |" in text and "|  | mean | 67 | 17 |" in text  # a missing cell is left out
    assert "| model | depth | 1K | 2K |" in text
    assert "| b | 0 | 100 | 100 |" in text and "| m | 0 | 100 | 0 |" in text and "|  | mean | 67 | 33 |" in text
    with pytest.raises(rb.SpecError, match="kind niah reads"):
        rb.render_niah([short], {})


def test_bench_attention_cells(tmp_path):
    res = {"suite": "attention", "command": "retrofit bench attention",
           "rows": [{"op": "latte", "mode": "fwd", "T": 16384, "time_s": 0.084, "speedup_vs_sdpa": 70.34},
                    {"op": "sdpa", "mode": "fwd", "T": 16384, "time_s": 101.2}]}
    section = "title: Ops\ntables:\n  - {kind: bench-attention, data: r.json, machine: m, commit: abcdef0}\n"
    text = rb.render(_page(tmp_path, section, {"r.json": res}), tmp_path)
    assert "| latte | fwd | 0.0840 s (70.3x) |" in text
    assert "| sdpa | fwd | 101 s |" in text


@pytest.mark.parametrize("table, message", [
    ("{kind: nope, data: t.json, machine: m, commit: c, command: x}", "table kind 'nope'"),
    ("{kind: table, data: missing.json, machine: m, commit: c, command: x}", "no such results file"),
    ("{kind: table, data: t.json, commit: c, command: x}", "lacks machine"),
])
def test_bad_specs_name_the_problem(tmp_path, table, message):
    bench = _page(tmp_path, f"title: S\ntables:\n  - {table}\n", {"t.json": {"columns": ["a"], "rows": [["1"]]}})
    with pytest.raises(rb.SpecError, match=message):
        rb.render(bench, tmp_path)


def test_a_table_entry_pasted_into_a_text_block_is_refused(tmp_path):
    entry = "{kind: table, data: t.json, machine: m, commit: c, command: x}"
    bench = _page(tmp_path, f"title: S\ntables:\n  - {entry}\nafter: |\n  Closing words.\n\n  - kind: table\n    data: t.json\n",
                  {"t.json": {"columns": ["a"], "rows": [["1"]]}})
    with pytest.raises(rb.SpecError, match="inside the 'after' text block"):
        rb.render(bench, tmp_path)


def test_row_width_is_checked(tmp_path):
    bench = _page(tmp_path, "title: S\ntables:\n  - {kind: table, data: t.json, machine: m, commit: c, command: x}\n",
                  {"t.json": {"columns": ["a", "b"], "rows": [["1"]]}})
    with pytest.raises(rb.SpecError, match="1 cells for 2 columns"):
        rb.render(bench, tmp_path)
