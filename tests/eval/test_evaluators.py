"""The evaluator registry: a kind registered in one place shows up in the CLI, run_all and report.md."""
from __future__ import annotations

import argparse
import json
import sys
import types

import pytest

from retrofit.errors import RetrofitError
from retrofit.eval import evaluators as registry
from retrofit.eval.evaluators import Evaluator, evaluators, get_evaluator, register_evaluator


def test_builtin_kinds_in_order():
    assert [e.name for e in evaluators()] == ["perplexity", "harness", "passkey", "niah", "ruler"]
    assert [e.command for e in evaluators()] == ["ppl", "harness", "passkey", "niah", "ruler"]
    assert get_evaluator("passkey").run == "retrofit.eval.passkey:run_passkey"
    for ev in evaluators():
        assert callable(ev.runner())
    with pytest.raises(RetrofitError, match="unknown evaluator 'nope'"):
        get_evaluator("nope")


def _echo_run(model, *, out=None, tokenizer=None, device="cpu", baseline=None, baseline_tokenizer=None,
              dtype=None, command=None, words=("x",)):
    res = {"kind": "echo", "description": "Echo.", "table": "| w |\n| --- |\n" + "\n".join(f"| {w} |" for w in words),
           "images": [], "words": list(words)}
    if out is not None:
        from retrofit.eval import report

        res["out"] = str(out)
        report.save_results(out, res)
    return res


@pytest.fixture
def echo_kind(monkeypatch):
    """A fourth evaluator kind, registered the way a new module would register it."""
    module = types.ModuleType("retrofit_test_echo_eval")
    module.run = _echo_run
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def add_arguments(p: argparse.ArgumentParser, prefix: str) -> None:
        p.add_argument(f"--{prefix}words", dest="echo_words", nargs="+", default=["a", "b"])

    ev = Evaluator(name="echo", command="echo", subdir="echo", heading="Echo section", help="echo words",
                   add_arguments=add_arguments, kwargs=lambda args: {"words": args.echo_words},
                   run=f"{module.__name__}:run", order=40)
    register_evaluator(ev)
    yield ev
    registry._REGISTRY.pop("echo", None)


def test_a_new_kind_reaches_cli_suite_and_report(echo_kind, tmp_path, capsys):
    from retrofit.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["eval", "echo", "m", "--words", "p", "q"])
    assert args.evaluator == "echo" and args.echo_words == ["p", "q"]
    all_args = parser.parse_args(["eval", "all", "m", "--echo-words", "z", "--skip", "echo"])
    assert all_args.echo_words == ["z"] and all_args.skip == ["echo"]

    from retrofit.eval import report, suite

    sections = {"echo": _echo_run(None, out=tmp_path / "echo", words=["hello"])}
    rep = report.write_report(tmp_path, sections, title="T")
    assert "## Echo section" in rep["markdown"] and "| hello |" in rep["markdown"]
    assert json.loads((tmp_path / "echo" / "results.json").read_text())["words"] == ["hello"]
    # run_all runs the new kind into its subdir and reports it; options for unknown kinds are refused
    import torch

    res = suite.run_all(torch.nn.Linear(2, 2), tokenizer=object(), out=tmp_path / "all",
                        skip=["perplexity", "harness", "passkey", "niah", "ruler"], echo={"words": ["w1", "w2"]})
    assert res["echo"]["words"] == ["w1", "w2"] and (tmp_path / "all" / "echo" / "table.md").is_file()
    assert "## Echo section" in (tmp_path / "all" / "report.md").read_text()
    with pytest.raises(RetrofitError, match="not evaluators"):
        suite.run_all(object(), tokenizer=object(), out=tmp_path / "x", nope={})


def test_a_taken_command_is_refused(echo_kind):
    clash = Evaluator(name="other", command="echo", subdir="o", heading="O", help="o",
                      add_arguments=lambda p, prefix: None, kwargs=lambda a: {}, run="x:y")
    with pytest.raises(RetrofitError, match="taken by 'echo'"):
        register_evaluator(clash)
