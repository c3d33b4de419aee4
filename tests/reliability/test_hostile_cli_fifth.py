"""The hostile re-test, fifth pass: sizes that never end, outputs inside their input, a plugin that raises,
paths that are there but are no file, a bench that measures nothing, and one error prefix per command; each on
a tiny random model.

Every refusal is one ``error:`` line (exit 1, no traceback), before any model loads where the flags already
tell; a run that fails leaves nothing it wrote behind.
"""
from __future__ import annotations

import os
import shutil
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from retrofit.cli.main import main
from tests.reliability.test_faults import fails, leftovers, recipe_file, snapshot
from tests.reliability.test_hostile_cli import no_model_loads  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

HUGE = ["99999999999999999999", str(10**12)]
HEDGEHOG = {"method": "hedgehog", "window": 8, "sinks": 2, "features": 8, "memory_distance": 8}  # a fittable method


@pytest.fixture
def no_run(monkeypatch):
    """Training, fitting and benchmarking fail the test's expectations (the refusal must come first)."""
    from retrofit.bench import decode
    from retrofit.train import entry, fit

    def refuse(*args, **kwargs):
        raise RuntimeError("the run started before its sizes were checked")

    monkeypatch.setattr(entry, "train", refuse)
    monkeypatch.setattr(fit, "run_fit", refuse)
    monkeypatch.setattr(decode, "run_decode_benchmark", refuse)


# ---------------------------------------------------------------------- 4. one error prefix per command
@pytest.mark.parametrize("argv, bad_value, prefix", [
    (["eval", "ppl", "/no/such/model", "--lengths", "16"], ["--lengths", "abc"], "retrofit eval ppl: error: "),
    (["eval", "all", "/no/such/model"], ["--ppl-lengths", "abc"], "retrofit eval all: error: "),
    (["bench", "attention", "--ops", "flashy", "--no-isolate"], ["--heads", "0"], "retrofit bench attention: error: "),
    (["convert", "/no/such/model", "--out", "x"], ["--probe-tokens", "x"], "retrofit convert: error: "),
])
def test_an_error_names_the_command_as_argparse_does(tmp_path, capsys, monkeypatch, argv, bad_value, prefix):
    # eval ppl's flag errors said "retrofit eval ppl: error:" and its other errors "retrofit eval: error:"
    monkeypatch.chdir(tmp_path)
    line = fails(argv, capsys)
    assert line.startswith(prefix), line
    with pytest.raises(SystemExit):  # argparse's refusal of a flag's value names the same command
        main([*argv, *bad_value])
    assert prefix in capsys.readouterr().err
