"""The hostile re-test, third pass: numbers no run can use and texts too short to score, on every verb;
each on a tiny random model.

Every refusal is one ``error:`` line (exit 1, no traceback), before any model loads where the flags
already tell; a run that scores nothing fails instead of writing a table of empty cells.
"""
from __future__ import annotations

import json

import pytest

from retrofit.cli.main import main
from tests.reliability.test_faults import convert_argv, fails, leftovers

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test's expectations (the refusal must come first)."""
    from retrofit.eval import loading
    from retrofit import surgery

    def refuse(*args, **kwargs):
        raise RuntimeError("a model was loaded before the flags were checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(surgery, "load_any", refuse)


def _ppl(model, out, *extra) -> list[str]:
    return ["eval", "ppl", str(model), "--lengths", "16", "--max-windows", "1", "--quiet", "--out", str(out), *extra]


# ---------------------------------------------------------------------- --zero-shot values
@pytest.mark.parametrize("variant, needles", [
    ("yarn:inf", ["'yarn:inf'", "a finite factor"]),
    ("dynamic:nan", ["'dynamic:nan'"]),
    ("cap:99999999999", ["'cap:99999999999'", "at most 2147483647 tokens"]),
    ("tier:99999999999", ["'tier:99999999999'", "at most 2147483647 tokens"]),
    ("retrieve:99999999999", ["'retrieve:99999999999'", "at most 2147483647 tokens"]),
])
def test_zero_shot_values_no_model_takes_fail_before_any_model_loads(base, tmp_path, capsys, no_model_loads,
                                                                      variant, needles):
    out = tmp_path / "out"
    fails(_ppl(base, out, "--zero-shot", variant), capsys, *needles)
    assert not out.exists()


def test_a_zero_shot_value_keeps_every_digit_from_the_flag_to_the_results(base, tmp_path, capsys):
    from retrofit.eval.variants import parse_variant

    for text in ("cap:1000000", "cap:1234567", "dynamic:1.0000001", "yarn:4.1234567", "yarn:4", "tier:512"):
        assert parse_variant(text).spec == text and parse_variant(parse_variant(text).spec) == parse_variant(text)
    out = tmp_path / "out"  # a cap of a million tokens (a 1M-context base) was refused after the models loaded
    assert main(_ppl(base, out, "--zero-shot", "cap:1000000", "yarn:4.1234567")) == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["zero_shot"] == ["cap:1000000", "yarn:4.1234567"]


# ---------------------------------------------------------------------- eval ppl on too little text
@pytest.mark.parametrize("text", ["", "a few words only.\n"])
def test_eval_ppl_on_a_text_shorter_than_every_length_fails_instead_of_an_empty_table(base, tmp_path, capsys, text):
    data = tmp_path / "short.txt"
    data.write_text(text)
    out = tmp_path / "out"
    fails(_ppl(base, out, "--datasets", str(data), "--lengths", "64"), capsys, "nothing to score", "short.txt",
          "64 tokens", "shorter length")
    assert not (out / "results.json").exists() and not leftovers(tmp_path)
    # a text long enough for the shorter of two lengths is scored, and the longer one's cell says why it is empty
    data.write_text("word " * 40)
    assert main(_ppl(base, out, "--datasets", str(data), "--lengths", "16", "1K")) == 0
    cells = json.loads((out / "results.json").read_text())["results"]["short.txt"]
    assert cells["16"]["model"]["ppl"] is not None and cells["1024"]["model"]["error"] == "no windows"


# ---------------------------------------------------------------------- eval ruler lengths below the answer budget
def test_a_ruler_length_below_the_answer_budget_names_the_length_and_the_budget(base, tmp_path, capsys):
    argv = ["eval", "ruler", str(base), "--tasks", "niah_single_1", "--samples", "1", "--quiet", "--lengths", "16"]
    fails([*argv, "--out", str(tmp_path / "a")], capsys, "length 16 leaves no room", "128 answer tokens",
          "niah_single_1's RULER answer budget", "lengths above 128")
    fails([*argv, "--max-new-tokens", "20", "--out", str(tmp_path / "b")], capsys, "length 16", "20 answer tokens",
          "(--max-new-tokens)", "or a smaller --max-new-tokens")


# ---------------------------------------------------------------------- generate and convert numbers
@pytest.mark.parametrize("flags, needles", [
    (["--temperature", "nan"], ["--temperature must be a finite number >= 0"]),  # was a silent greedy run
    (["--temperature", "inf"], ["--temperature must be a finite number >= 0"]),  # was a uniform sampler
    (["--temperature", "1", "--seed", str(10**24)], ["--seed 1000000000000000000000000 is beyond what torch takes"]),
])
def test_generate_refuses_numbers_no_sampler_takes_before_the_model_loads(base, capsys, no_model_loads, flags, needles):
    fails(["generate", str(base), "--prompt", "hi", "--device", "cpu", *flags], capsys, *needles)


def test_convert_refuses_a_seed_torch_cannot_take(base, tmp_path, capsys):
    out = tmp_path / "out"
    fails(convert_argv(base, out, "--seed", str(10**24)), capsys, f"seed={10**24} is beyond what torch takes")
    assert not out.exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------- eval --out inside the text it reads
def test_eval_out_inside_a_data_folder_is_refused_before_any_model_loads(base, books, tmp_path, capsys, no_model_loads):
    # the first run succeeded, the next over the same folder read results.json as a document and failed
    fails(_ppl(base, books / "o", "--datasets", str(books)), capsys, f"--out {books / 'o'} lies in the data folder",
          "(--datasets)", "elsewhere")
    fails(_ppl(base, books, "--datasets", "pg-books", str(books)), capsys, "lies in the data folder")
    fails(["eval", "passkey", str(base), "--haystack", str(books), "--out", str(books / "pk")], capsys,
          "lies in the data folder", "(--haystack)")
    fails(["eval", "all", str(base), "--niah-haystack", str(books), "--out", str(books / "all")], capsys,
          "(--niah-haystack)")
    assert sorted(p.name for p in books.iterdir()) == sorted(p.name for p in books.glob("*.txt"))


# ---------------------------------------------------------------------- bytes that are not UTF-8, an empty config
def test_a_prompt_that_is_not_utf8_is_one_error_line_before_the_model_loads(base, capsys, monkeypatch, no_model_loads):
    import io
    import sys

    argv = ["generate", str(base), "--device", "cpu", "--prompt"]
    # a byte the shell passed that is not UTF-8 arrives as a lone surrogate: the tokenizer's TypeError before
    fails([*argv, "\udcffab"], capsys, "--prompt is not UTF-8 text", "byte 0")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff\xfe binary")))
    fails([*argv, "-"], capsys, "stdin (--prompt -) is not UTF-8 text", "byte 3")


@pytest.mark.parametrize("flags, needle", [
    (["--question", "\udcffwhat"], "--question"),
    (["--needle", "a needle", "--answers", "\udcffx"], "--answers"),
])
def test_niah_texts_that_are_not_utf8_are_one_error_line_before_any_model_loads(base, tmp_path, capsys, no_model_loads,
                                                                                flags, needle):
    fails(["eval", "niah", str(base), "--lengths", "512", "--out", str(tmp_path / "o"), *flags], capsys,
          f"{needle} '\\udcff", "is not UTF-8 text")


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n"])
def test_an_empty_conversion_config_is_refused_not_taken_for_the_defaults(base, tmp_path, capsys, text):
    config = tmp_path / "convert.yaml"
    config.write_text(text)
    out = tmp_path / "out"
    fails(["convert", str(base), "--out", str(out), "--config", str(config), "--probe-tokens", "0"], capsys,
          f"conversion config {config} is empty", "drop --config")
    assert not out.exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------- bench --converted
@pytest.mark.parametrize("suite", ["decode", "model"])
def test_bench_refuses_a_plain_model_as_the_converted_one(base, tmp_path, capsys, suite):
    # it was timed and tabled as "converted" beside itself, with a speedup from noise alone
    out = tmp_path / "out"
    fails(["bench", suite, "--model", str(base), "--converted", str(base), "--lengths", "64", "--out", str(out)],
          capsys, f"--converted {base} is a plain model, not a converted checkpoint")
    assert not out.exists()


# ---------------------------------------------------------------------- training records without their text
@pytest.mark.parametrize("record, needles", [
    ({"body": "a document under another field"}, ["a document has no 'text' field", "its fields: body"]),
    ({"text": 5}, ["'5' (int), not text, in its 'text' field"]),
])
def test_jsonl_records_without_a_text_field_are_named_not_counted_as_zero_tokens(base, tmp_path, capsys, record,
                                                                                  needles):
    from tests.reliability.test_faults import recipe_file

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record) + "\n")
    recipe = recipe_file(tmp_path, base, data)
    fails(["train", str(recipe)], capsys, "the training data (data.jsonl)", *needles, "set data.text_field")
    assert not (tmp_path / "out").exists()
