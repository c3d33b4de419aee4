"""BENCHMARKS.md is rendered from benchmarks/ by scripts/render_benchmarks.py: the committed page
must equal a fresh rendering, and each table kind renders the files the CLI verbs write."""
from __future__ import annotations

import importlib.util
import json
import re
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


PAGE = "title: T\nexempt: [SmolLM2-135M]\nquestions:\n  q: Why?\n"


def _page(tmp_path: Path, section: str, files: dict[str, dict], page: str = PAGE) -> Path:
    bench = tmp_path / "benchmarks"
    (bench / "10-x").mkdir(parents=True)
    (bench / "page.yaml").write_text(page)
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
question: q
table:
  kind: ppl
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
    page = PAGE + "  r: What else?\n"
    bench = _page(tmp_path, "title: S\nquestion: q\ntable: {kind: passkey, data: pk.json, machine: m, commit: 1234567}\n",
                  {"pk.json": passkey}, page)
    (bench / "20-y").mkdir()
    (bench / "20-y" / "section.yaml").write_text("title: T2\nquestion: r\ntable: {kind: table, data: t.json}\n")
    (bench / "20-y" / "t.json").write_text(json.dumps(table))
    text = rb.render(bench, tmp_path)
    assert "| model (depth 0 / 0.5 / 1) | 4K |" in text
    assert "| b | 100 / 80 / 0 |" in text and "| m | 0 / 80 / 0 |" in text
    assert "| x | 0.070 |" in text and "A note." in text and "Commit: per row." in text
    assert "*Why?*" in text and "- [Why?](#s)" in text and "- [What else?](#t2)" in text
    only_depth_0 = rb.render_passkey([passkey], {"depths": [0]})
    assert "| model (depth 0) | 4K |" in only_depth_0 and "| b | 100 |" in only_depth_0


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
    section = "title: S\nquestion: q\ntable: {kind: ruler, data: [r4.json, r32.json], machine: m, commit: 1234567, labels: {m: conv}}\n"
    text = rb.render(_page(tmp_path, section, {"r4.json": short, "r32.json": long}), tmp_path)
    text += rb.render_niah([niah], {})
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
    section = "title: Ops\nquestion: q\ntable: {kind: bench-attention, data: r.json, machine: m, commit: abcdef0}\n"
    text = rb.render(_page(tmp_path, section, {"r.json": res}), tmp_path)
    assert "| latte | fwd | 0.0840 s (70.3x) |" in text
    assert "| sdpa | fwd | 101 s |" in text


@pytest.mark.parametrize("table, message", [
    ("{kind: nope, data: t.json, machine: m, commit: c, command: x}", "table kind 'nope'"),
    ("{kind: table, data: missing.json, machine: m, commit: c, command: x}", "no such results file"),
    ("{kind: table, data: t.json, commit: c, command: x}", "lacks machine"),
])
def test_bad_specs_name_the_problem(tmp_path, table, message):
    bench = _page(tmp_path, f"title: S\nquestion: q\ntable: {table}\n", {"t.json": {"columns": ["a"], "rows": [["1"]]}})
    with pytest.raises(rb.SpecError, match=message):
        rb.render(bench, tmp_path)


def test_a_table_entry_pasted_into_a_text_block_is_refused(tmp_path):
    entry = "{kind: table, data: t.json, machine: m, commit: c, command: x}"
    bench = _page(tmp_path, f"title: S\nquestion: q\ntable: {entry}\nafter: |\n  Closing words.\n\n  - kind: table\n    data: t.json\n",
                  {"t.json": {"columns": ["a"], "rows": [["1"]]}})
    with pytest.raises(rb.SpecError, match="inside the 'after' text block"):
        rb.render(bench, tmp_path)


def test_row_width_is_checked(tmp_path):
    bench = _page(tmp_path, "title: S\nquestion: q\ntable: {kind: table, data: t.json, machine: m, commit: c, command: x}\n",
                  {"t.json": {"columns": ["a", "b"], "rows": [["1"]]}})
    with pytest.raises(rb.SpecError, match="1 cells for 2 columns"):
        rb.render(bench, tmp_path)


# ---------------------------------------------------------------------------- one results set per question

TABLE = {"columns": ["model", "16K", "32K", "cache MiB"],
         "rows": [["base", "22.52", "22.98", "1,440"], ["conversion", "23.05", "23.70", "62.3"]]}
ENTRY = "{kind: table, data: t.json, machine: m, commit: abc1234, command: x}"


def test_two_sections_answering_one_question_are_refused(tmp_path):
    bench = _page(tmp_path, f"title: S\nquestion: q\ntable: {ENTRY}\n", {"t.json": TABLE})
    (bench / "20-newer").mkdir()
    (bench / "20-newer" / "section.yaml").write_text(f"title: S2\nquestion: q\ntable: {ENTRY}\n")
    (bench / "20-newer" / "t.json").write_text(json.dumps(TABLE))
    with pytest.raises(rb.SpecError, match="question 'q' is answered twice, by 10-x and 20-newer"):
        rb.render(bench, tmp_path)


@pytest.mark.parametrize("section, message", [
    (f"title: S\nquestion: nope\ntable: {ENTRY}\n", "question 'nope' is not one of page.yaml's questions"),
    (f"title: S\nquestion: q\ntables:\n  - {ENTRY}\n  - {ENTRY}\n", "'tables' is gone"),
    ("title: S\nquestion: q\n", "needs one 'table'"),
])
def test_a_section_answers_one_known_question_with_one_table(tmp_path, section, message):
    with pytest.raises(rb.SpecError, match=message):
        rb.render(_page(tmp_path, section, {"t.json": TABLE}), tmp_path)


def test_a_question_nobody_answers_and_a_results_file_no_table_reads_are_refused(tmp_path):
    bench = _page(tmp_path, f"title: S\nquestion: q\ntable: {ENTRY}\n", {"t.json": TABLE},
                  PAGE + "  r: Unanswered?\n")
    with pytest.raises(rb.SpecError, match=r"questions \['r'\] have no section"):
        rb.render(bench, tmp_path)
    bench = _page(tmp_path / "b", f"title: S\nquestion: q\ntable: {ENTRY}\n", {"t.json": TABLE, "old.json": TABLE})
    with pytest.raises(rb.SpecError, match="old.json feeds no table"):
        rb.render(bench, tmp_path / "b")


# ---------------------------------------------------------------------------- numbers in the prose

@pytest.mark.parametrize("after", [
    "At 32K the conversion scores 23.70 against 22.98.",           # printed in the table
    "It is 3.1% above the capped base at 32K and 2.4% at 16K.",    # a ratio of two cells in one column
    "Its cache is 1/23 of the base's, 1,440 against 62.3 MiB.",    # a fraction of two cells in one column
    "Against the base: 1.03x, at 23.7 and 23.",                    # rounded, and a ratio
    "Run at 2847a58 on 2026-11-28 with `--lengths 16384 32768`; SmolLM2-135M at 16K, depths 0 / 0.5 / 1, 4 sinks.",
])
def test_prose_numbers_that_the_data_holds_pass(tmp_path, after):
    section = f"title: S\nquestion: q\ntable: {ENTRY}\nafter: |\n  {after}\n"
    assert after.split()[0] in rb.render(_page(tmp_path, section, {"t.json": TABLE}), tmp_path)


@pytest.mark.parametrize("where, prose, number", [
    ("after", "The conversion is 41% better.", "41%"),
    ("after", "It decodes 6.3x faster.", "6.3x"),
    ("text", "It scores 23.31 at 32K.", "23.31"),
    ("after", "Its cache is 1/31 of the base's.", "1/31"),
    ("after", "The base is 8-9% better.", "8-9%"),
    ("after", "It took 56.5 minutes.", "56.5"),
])
def test_prose_numbers_that_the_data_lacks_are_refused(tmp_path, where, prose, number):
    section = f"title: S\nquestion: q\ntable: {ENTRY}\n{where}: |\n  {prose}\n"
    with pytest.raises(rb.SpecError, match=f"10-x: the number '{re.escape(number)}' in its {where}"):
        rb.render(_page(tmp_path, section, {"t.json": TABLE}), tmp_path)


def test_table_notes_and_the_json_notes_are_checked_too(tmp_path):
    section = "title: S\nquestion: q\ntable: {kind: table, data: t.json, machine: m, commit: c, command: x, notes: Took 12.5 s.}\n"
    with pytest.raises(rb.SpecError, match="'12.5' in its table note 1"):
        rb.render(_page(tmp_path, section, {"t.json": TABLE}), tmp_path)
    noted = {**TABLE, "notes": "A run of 77 minutes."}
    section = f"title: S\nquestion: q\ntable: {ENTRY}\n"
    with pytest.raises(rb.SpecError, match="'77'"):
        rb.render(_page(tmp_path / "a", section, {"t.json": noted}), tmp_path / "a")
    silent = "title: S\nquestion: q\ntable: {kind: table, data: t.json, machine: m, commit: c, command: x, json_notes: false}\n"
    assert "77 minutes" not in rb.render(_page(tmp_path / "b", silent, {"t.json": noted}), tmp_path / "b")


def test_generic_table_row_column_and_label_choices(tmp_path):
    spec = {"rows": [1], "columns": [0, 2], "labels": {"conversion": "converted"}, "headers": ["model", "at 32K"]}
    text = rb.render_generic([TABLE], spec)
    assert text.splitlines()[0] == "| model | at 32K |" and "| converted | 23.70 |" in text and "base" not in text


def test_the_pages_name_no_folder_outside_the_repository():
    for path in [ROOT / "BENCHMARKS.md", ROOT / "docs" / "findings.md", *sorted((ROOT / "benchmarks").rglob("*")),
                 *sorted((ROOT / "docs" / "findings").rglob("*"))]:
        if path.is_file():
            assert "shared/" not in path.read_text(encoding="utf-8"), f"{path} names a folder outside the repository"
