"""The hostile re-test, fourth pass: a reader that leaves the pipe, empty names and texts, sizes beyond the
model, dtypes no model runs in; each on a tiny random model.

Every refusal is one ``error:`` line (exit 1, no traceback), before any model loads where the flags already
tell; a run that fails leaves no folder it created behind.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from retrofit.cli.main import main
from tests.reliability.test_faults import convert_argv, fails, leftovers, recipe_file
from tests.reliability.test_hostile_cli import no_model_loads  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ---------------------------------------------------------------------- a reader that leaves the pipe
def test_a_closed_stdout_pipe_ends_quietly_not_with_a_disk_error():
    # `retrofit ls --json | head -c 20` printed "error: Broken pipe; check the path and the disk"
    import os

    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    code = "import sys; from retrofit.cli.main import main; sys.exit(main(['ls', '--json']))"
    done = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    os.close(write)
    assert done.returncode == 141, done.stderr
    assert "error" not in done.stderr and "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr


# ---------------------------------------------------------------------- sizes beyond the model
def test_sinks_beyond_the_models_positions_are_refused_before_saving(base, tmp_path, capsys):
    out = tmp_path / "out"
    fails(convert_argv(base, out, "--sinks", "5000"), capsys, "sinks=5000 exceeds the model's "
          "max_position_embeddings=1024", "at most 1024")
    assert not out.exists() and not leftovers(tmp_path)
    assert main(convert_argv(base, out, "--sinks", "1024", "-q")) == 0  # every position a sink: allowed


# ---------------------------------------------------------------------- empty texts and names
@pytest.mark.parametrize("flags, needles", [
    (["--question", ""], ["--question is empty"]),
    (["--question", "   "], ["--question is empty"]),
    (["--needle", " ", "--answers", "x"], ["--needle is empty"]),
    (["--needle", "The key is 7.", "--answers", " "], ["--answers holds no text"]),
])
def test_an_empty_niah_needle_question_or_answer_fails_before_any_model_loads(base, tmp_path, capsys, no_model_loads,
                                                                              flags, needles):
    # an empty question ran the whole grid and scored whatever the model said to nothing
    fails(["eval", "niah", str(base), "--lengths", "512", "--out", str(tmp_path / "o"), *flags], capsys, *needles)
    assert not (tmp_path / "o").exists()


def test_niah_answers_missing_from_the_needle_are_named_in_a_warning(base, tmp_path, capsys, no_model_loads):
    argv = ["eval", "niah", str(base), "--lengths", "512", "--out", str(tmp_path / "o"), "--needle", "The key is 7.",
            "--answers", "7", "8"]
    with pytest.raises(RuntimeError, match="a model was loaded"):  # a warning, then the run goes on
        main(argv)
    err = capsys.readouterr().err
    assert "--answers '8' not in --needle" in err and "scores at most 50%" in err, err
    with pytest.raises(RuntimeError, match="a model was loaded"):
        main([*argv[:-2], "the KEY is"])  # found as the scoring finds it: case-insensitively
    assert "not in --needle" not in capsys.readouterr().err


@pytest.mark.parametrize("command, flags, flag", [
    ("ppl", ["--datasets", "x.txt", ""], "--datasets"),
    ("ppl", ["--datasets", " "], "--datasets"),
    ("passkey", ["--haystack", ""], "--haystack"),
    ("niah", ["--haystack", ""], "--haystack"),
    ("ruler", ["--haystack", ""], "--haystack"),
    ("all", ["--niah-haystack", ""], "--niah-haystack"),
])
def test_an_empty_dataset_name_fails_before_any_model_loads(base, tmp_path, capsys, no_model_loads, command, flags,
                                                            flag):
    # an empty path is the current folder: every text file in it was read (or the first bad one named)
    fails(["eval", command, str(base), "--out", str(tmp_path / "o"), *flags], capsys,
          f"{flag} holds an empty name", "retrofit ls datasets")


@pytest.mark.parametrize("files", ["", ["", "books"]])
def test_an_empty_training_data_path_is_refused_not_read_as_the_recipes_folder(base, books, tmp_path, capsys, files):
    import yaml

    recipe = recipe_file(tmp_path, base, books)
    d = yaml.safe_load(recipe.read_text())
    d["data"]["files"] = files if files == "" else ["", str(books)]
    recipe.write_text(yaml.safe_dump(d))
    (tmp_path / "stray.txt").write_text("a file beside the recipe " * 200)  # what '' trained on
    fails(["train", str(recipe)], capsys, "the data files name an empty path ('')")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- eval ppl windows of 2 tokens
def test_a_two_token_window_with_bos_fails_before_any_model_loads(base, books, tmp_path, capsys, no_model_loads):
    # it was refused by the window builder, after the models loaded
    argv = ["eval", "ppl", str(base), "--lengths", "2", "16", "--datasets", str(books), "--out", str(tmp_path / "o")]
    fails(argv, capsys, "window length 2 is too short", "(--bos auto)", "3 or more, or --bos never")
    fails([*argv, "--bos", "always"], capsys, "(--bos always)")
    fails(["eval", "all", str(base), "--ppl-lengths", "2", "--out", str(tmp_path / "a")], capsys,
          "window length 2 is too short")


def test_a_two_token_window_without_bos_is_scored(base, books, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["eval", "ppl", str(base), "--lengths", "2", "--datasets", str(books), "--max-windows", "1",
                 "--bos", "never", "--quiet", "--out", str(out)]) == 0, capsys.readouterr().err
    assert (out / "results.json").is_file()


# ---------------------------------------------------------------------- dtypes no model runs in
@pytest.mark.parametrize("dtype", ["int8", "bool", "complex64", "float8_e4m3fn"])
def test_generate_refuses_a_dtype_no_model_runs_in_before_it_loads(base, capsys, no_model_loads, dtype):
    # int8 was reported as "cannot rebuild the converted architecture", as if the checkpoint were broken
    fails(["generate", str(base), "--prompt", "hi", "--device", "cpu", "--dtype", dtype], capsys,
          f"dtype '{dtype}' cannot hold a model's weights", "float32, bfloat16 or float16")


# ---------------------------------------------------------------------- folders a failed run made
def test_a_failed_convert_leaves_no_empty_parent_folders(base, tmp_path, capsys):
    # the output lock made the --out's missing parents; a run that failed left them behind, empty
    out = tmp_path / "a" / "b" / "out"
    fails(convert_argv(base, out, "--latents", "3"), capsys, "latents=3")
    assert not (tmp_path / "a").exists()
    (tmp_path / "a").mkdir()  # a folder that was there before the run stays, empty or not
    fails(convert_argv(base, out, "--latents", "3"), capsys, "latents=3")
    assert (tmp_path / "a").is_dir() and not (tmp_path / "a" / "b").exists()
    assert main(convert_argv(base, out, "-q")) == 0 and (out / "config.json").is_file()


# ---------------------------------------------------------------------- recipe overrides after a flag
@pytest.mark.parametrize("verb", ["train", "fit"])
def test_an_override_without_its_value_after_a_flag_is_named_like_one_before_it(base, books, tmp_path, capsys, verb):
    # after a flag it was argparse's "retrofit: error: unrecognized arguments: train.lr" under the top usage
    recipe = recipe_file(tmp_path, base, books)
    fails([verb, str(recipe), "-q", "train.lr"], capsys, "override 'train.lr' must look like section.key=value")


# ---------------------------------------------------------------------- a bench whose every point timed out
def test_a_bench_plot_without_any_measurement_warns_nothing(tmp_path):
    # matplotlib's "No artists with labels found to put in legend" was printed under the table
    pytest.importorskip("matplotlib")
    from retrofit.bench import attention, decode, model

    hardware = {"gpu": None, "cpu_model": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention._plot({"rows": [{"op": "latte", "mode": "-", "T": 64, "time_s": None}], "hardware": hardware,
                         "config": {"batch": 1, "heads": 2, "head_dim": 8, "latents": 4, "latents_per_head": 2,
                                    "window": 8, "dtype": "float32"}}, tmp_path / "a.png")
        decode._plot({"rows": [{"model": "base", "T": 64, "error": "timed out"}], "hardware": hardware,
                      "models": {"base": "b", "converted": "c"}, "config": {"dtype": "float32"}}, tmp_path / "d.png")
        model._plot({"rows": [{"model": "base", "kind": "prefill", "T": 64, "error": "timed out"}],
                     "hardware": hardware, "config": {"dtype": "float32"}}, tmp_path / "m.png")
    assert (tmp_path / "a.png").is_file() and (tmp_path / "d.png").is_file() and (tmp_path / "m.png").is_file()


# ---------------------------------------------------------------------- a value given twice, YAML that does not parse
@pytest.mark.parametrize("flags, needle", [
    (["--latents", "16", "--option", "latents=8"], "--latents 16 and --option latents=8 disagree"),
    (["--option", "latents=8", "--option", "latents=16"], "--option latents=8 and --option latents=16 disagree"),
])
def test_a_method_key_given_twice_with_two_values_is_refused(base, tmp_path, capsys, flags, needle):
    # the --option value won silently over the flag (latents=8 converted where --latents 16 was asked)
    out = tmp_path / "out"
    fails(["convert", str(base), "--out", str(out), "--window", "8", "--probe-tokens", "0", *flags], capsys, needle,
          "give the value once")
    assert not out.exists()
    assert main(["convert", str(base), "--out", str(out), "--window", "8", "--probe-tokens", "0", "-q",
                 "--latents", "8", "--option", "latents=8"]) == 0  # the same value twice is no conflict


def test_yaml_that_does_not_parse_is_one_error_line_naming_where(base, books, tmp_path, capsys):
    # PyYAML's message spans four lines, with a caret under the bad one
    config = tmp_path / "convert.yaml"
    config.write_text("method: macchiato\nwindow: [\n")
    line = fails(["convert", str(base), "--out", str(tmp_path / "o"), "--config", str(config)], capsys,
                 "is not valid YAML", "at line 3, column 1")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {name: [\n")
    line = fails(["train", str(recipe)], capsys, "is not valid YAML", "at line 2, column 1")
    assert "^" not in capsys.readouterr().err + line
