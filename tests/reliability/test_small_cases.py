"""Smaller cases of the hostile re-test: -q, outputs that would write into a model folder, a --overwrite
that would lose a file the user edited, and Ctrl-C at any point of a run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from retrofit.cli.main import main
from tests.reliability.test_faults import convert_argv, fails, leftovers, recipe_file, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, base) -> Path:
    out = tmp_path_factory.mktemp("conv") / "conv"
    assert main(convert_argv(base, out)) == 0
    return out


# ---------------------------------------------------------------------- generate -q
def test_quiet_generate_prints_the_text_alone(converted, capsys):
    capsys.readouterr()
    assert main(["generate", str(converted), "--prompt", "Call me", "--max-new-tokens", "3", "-q"]) == 0
    got = capsys.readouterr()
    assert "Call me" in got.out and "tokens in" not in got.err + got.out
    assert main(["generate", str(converted), "--prompt", "Call me", "--max-new-tokens", "3"]) == 0
    assert "tokens in" in capsys.readouterr().err  # without -q the stats line stays


# ---------------------------------------------------------------------- outputs inside a model folder
def test_train_output_dir_is_never_the_input_model_folder(base, books, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(base, model)
    (model / "recipe.yaml").write_text("the model's own notes\n")
    before = snapshot(model)
    for out in (model, model / "runs"):
        recipe = recipe_file(tmp_path, model, books, checkpoint={"output_dir": str(out)})
        where = "is" if out == model else "lies inside"
        fails(["train", str(recipe)], capsys, f"{where} the input model folder", "outside the model")
        fails(["fit", str(recipe)], capsys, f"{where} the input model folder")
    assert snapshot(model) == before and not (model / "runs").exists()


@pytest.mark.parametrize("suite", ["decode", "model"])
def test_bench_out_is_never_a_model_or_checkpoint_folder(converted, base, tmp_path, capsys, suite):
    before = snapshot(converted)
    args = ["bench", suite, "--quick", "--quiet", "--converted", str(converted), "--model", str(base)]
    fails([*args, "--out", str(converted)], capsys, "model folder", "elsewhere")
    fails([*args, "--out", str(base / "bench")], capsys, "lies inside the model folder")
    other = tmp_path / "ckpt"  # a training checkpoint that is not an input of this bench
    other.mkdir()
    (other / "trainer_state.json").write_text("{}")
    fails(["bench", suite, "--quick", "--quiet", "--out", str(other)], capsys, "holds a model or checkpoint",
          "trainer_state.json")
    assert snapshot(converted) == before and not (base / "bench").exists()
    assert sorted(p.name for p in other.iterdir()) == ["trainer_state.json"]


# ---------------------------------------------------------------------- the manifest: sizes and content
def test_overwrite_never_replaces_a_file_the_user_edited(base, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(convert_argv(base, out)) == 0
    manifest = json.loads((out / ".retrofit-files.json").read_text())
    assert set(manifest["records"]) == set(manifest["files"]) and "config.json" in manifest["records"]
    edits = {
        "grown": lambda f: f.write_text(f.read_text() + "\n"),
        "same size": lambda f: f.write_text(f.read_text().replace('"eos_token_id": 2', '"eos_token_id": 3')),
    }
    for name, edit in edits.items():
        cfg = out / "config.json"
        original = cfg.read_bytes()
        edit(cfg)
        assert cfg.read_bytes() != original, name
        before = snapshot(out)
        fails(convert_argv(base, out, "--window", "4", "--overwrite"), capsys, "config.json",
              "changed since retrofit wrote it")
        assert snapshot(out) == before and not leftovers(tmp_path)
        cfg.write_bytes(original)  # the same bytes again (a new time): hashed, found unchanged
    assert main(convert_argv(base, out, "--window", "4", "--overwrite")) == 0
    assert json.loads((out / "config.json").read_text())["retrofit"]["window"] == 4


# ---------------------------------------------------------------------- Ctrl-C
def test_an_interrupt_while_the_parsers_are_built_is_interrupted_130(base, tmp_path, capsys, monkeypatch):
    import retrofit.cli.main as cli

    real = cli.importlib.import_module

    def import_module(name, *args):
        if name == "retrofit.cli.eval":
            raise KeyboardInterrupt
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    assert main(convert_argv(base, tmp_path / "out")) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted" and not (tmp_path / "out").exists()


def _swallow_ctrl_c() -> None:
    """A Ctrl-C that a library catches (numpy mid-import): the CLI's handler still records it."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
        pass


def test_a_failure_after_a_swallowed_interrupt_is_interrupted_130(base, tmp_path, capsys, monkeypatch):
    # a library that catches Ctrl-C mid-import (numpy, half set up) makes a later step fail instead
    import retrofit.cli.convert as convert_cli
    from retrofit.errors import RetrofitError

    def build_spec(args):
        _swallow_ctrl_c()
        raise RetrofitError("cannot load the model folder")

    monkeypatch.setattr(convert_cli, "build_spec", build_spec)
    assert main(convert_argv(base, tmp_path / "out")) == 130
    assert capsys.readouterr().err.strip() == "interrupted" and not (tmp_path / "out").exists()


_CTRL_C = textwrap.dedent("""
    import os, signal, sys, threading
    from retrofit.cli.main import main

    threading.Timer(float(sys.argv[1]), os.kill, (os.getpid(), signal.SIGINT)).start()
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.parametrize("delay", [0.02, 0.1, 0.3, 1.0])
def test_ctrl_c_in_the_first_seconds_of_convert_prints_interrupted(base, tmp_path, delay):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", _CTRL_C, str(delay), *convert_argv(base, out)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    if done.returncode == 0:
        pytest.skip(f"convert finished before the interrupt at {delay}s")
    assert done.returncode == 130 and "interrupted" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not out.exists() and not leftovers(tmp_path)


def test_a_failure_while_the_parsers_are_built_after_a_swallowed_interrupt_is_interrupted_130(capsys, monkeypatch):
    # the import that Ctrl-C half-did fails outside the verb's own error handling (numpy's RecursionError)
    import retrofit.cli.main as cli_main

    def build_parser():
        _swallow_ctrl_c()
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(cli_main, "build_parser", build_parser)
    assert main(["ls"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
