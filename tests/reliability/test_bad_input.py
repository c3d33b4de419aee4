"""Bad numbers, bad text and bad config values: each is one ``error:`` line and a non-zero exit, never a
traceback, and refused before anything is written (a checkpoint that only fails later, in generate, is
the failure this guards against)."""
from __future__ import annotations

import json
import shutil

import pytest

from retrofit.cli.main import main
from tests.reliability.test_faults import convert_argv, fails, leftovers

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

HUGE = "99999999999999999999"


def refused(argv: list[str], capsys, *needles: str) -> str:
    """``retrofit ARGV`` stops with exactly one ``error:`` line holding ``needles``, exit != 0, no traceback."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's refusal of a flag value: usage line + one error line, exit 2
        rc = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc not in (0, None), err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("flag", ["--window", "--latents", "--sinks", "--chunk-size", "--rope-cap"])
def test_convert_refuses_sizes_beyond_any_model_before_saving(base, tmp_path, capsys, flag):
    out = tmp_path / "out"
    refused(convert_argv(base, out, flag, HUGE), capsys, f"={HUGE}", "at most 2147483647")
    assert not out.exists() and not leftovers(tmp_path)


def test_a_recipe_or_config_that_is_not_utf8_is_one_error_line(base, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"method: macchiato\nwindow: 8 # caf\xe9\n")
    refused(convert_argv(base, tmp_path / "out", "--config", str(bad)), capsys, str(bad), "not UTF-8", "byte 33")
    refused(["train", str(bad)], capsys, str(bad), "not UTF-8")
    refused(["fit", str(bad)], capsys, str(bad), "not UTF-8")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key,value", [("dtype", "float128"), ("num_attention_heads", 0), ("hidden_size", "x")])
def test_a_config_json_with_impossible_values_is_one_error_line(base, tmp_path, capsys, key, value):
    model = tmp_path / "model"
    shutil.copytree(base, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, key: value}))
    refused(convert_argv(model, tmp_path / "out"), capsys, str(model))
    refused(["generate", str(model), "--prompt", "a", "--max-new-tokens", "1"], capsys, str(model))
    refused(["eval", "ppl", str(model), "--lengths", "8", "--max-windows", "1", "--quiet", "--out",
             str(tmp_path / "ev")], capsys, str(model))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,needles", [
    (["eval", "ppl", "{base}", "--lengths", "99999999999999999999999"], ["--lengths", "at most 2147483647"]),
    (["eval", "ppl", "{base}", "--lengths", "8", "--chunk-size", "-5"], ["--chunk-size", "-5"]),
    (["eval", "ppl", "{base}", "--lengths", "8", "--max-windows", "-1"], ["--max-windows"]),
    (["eval", "passkey", "{base}", "--lengths", "64", "--key-digits", "0"], ["--key-digits", "0"]),
    (["eval", "passkey", "{base}", "--lengths", "64", "--key-digits", "64"], ["--key-digits 64", "64 tokens"]),
    (["eval", "passkey", "{base}", "--lengths", "64", "--prefill-chunk", "-1"], ["--prefill-chunk"]),
    (["bench", "decode", "--lengths", "0"], ["--lengths"]),
    (["bench", "decode", "--quick", "--new-tokens", "0"], ["--new-tokens", "0"]),
    (["bench", "decode", "--quick", "--prefill-chunk", "0"], ["--prefill-chunk", "0"]),
    (["bench", "decode", "--quick", "--batch", "0"], ["--batch"]),
    (["bench", "model", "--lengths", "0"], ["--lengths"]),
    (["bench", "model", "--quick", "--repeats", "0"], ["--repeats"]),
    (["bench", "attention", "--lengths", "0", "--no-isolate"], ["--lengths"]),
    (["bench", "attention", "--lengths", "64", "--no-isolate", "--heads", "0"], ["--heads"]),
    (["bench", "attention", "--lengths", "64", "--no-isolate", "--chunk-size", "0"], ["--chunk-size"]),
    (["bench", "attention", "--lengths", "64", "--no-isolate", "--max-seconds", "-1"], ["--max-seconds"]),
])
def test_eval_and_bench_numbers_out_of_range_are_one_error_line(base, tmp_path, capsys, argv, needles):
    out = tmp_path / "out"
    refused([a.replace("{base}", str(base)) for a in argv] + ["--out", str(out)], capsys, *needles)
    assert not out.exists()
