"""What a new user reads first: every verb's --help says what it does, and lists what it can run
from the registries rather than from a hand-written list."""
from __future__ import annotations

import argparse

import pytest

from retrofit.cli.main import build_parser
from retrofit.eval import evaluators as registry
from retrofit.eval.evaluators import Evaluator, evaluators


def _flat(text: str) -> str:
    return " ".join(text.split())


def _sub(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        parser = parser._subparsers._group_actions[0].choices[name]
    return parser


@pytest.fixture
def extra_kind(monkeypatch):
    """An evaluator registered the way a plugin registers one (removed again afterwards)."""
    ev = Evaluator(name="echo", command="echo", subdir="echo", heading="Echo", help="echo words",
                   add_arguments=lambda p, prefix: p.add_argument(f"--{prefix}words", dest="echo_words"),
                   kwargs=lambda args: {}, run="x:y", order=50)
    evaluators()  # the built-ins first
    monkeypatch.setitem(registry._REGISTRY, ev.name, ev)
    return ev


def test_eval_help_lists_every_registered_evaluator():
    parser = build_parser()
    text = _flat(_sub(parser, "eval").format_help())
    description = text.split("positional arguments:")[0]
    for command in [ev.command for ev in evaluators()] + ["all"]:
        assert command in description.split(": ", 1)[1], command
    assert {"ruler", "niah"} <= {ev.command for ev in evaluators()}
    assert "retrofit eval COMMAND --help" in text
    top = _flat(parser.format_help())
    assert "ppl, harness, passkey, niah, ruler, or all" in top


def test_eval_help_follows_the_registry(extra_kind):
    parser = build_parser()
    description = _flat(_sub(parser, "eval").format_help()).split("positional arguments:")[0]
    assert "echo" in description
    assert "echo" in _flat(parser.format_help())
    assert "+ ruler + echo, and one markdown report" in _flat(_sub(parser, "eval").format_help())


def test_demo_help_is_about_any_recipe():
    from retrofit.demo import DEFAULT_RECIPE

    parser = build_parser()
    demo = _sub(parser, "demo")
    description = _flat(demo.description)
    for words in ("recipe", "convert", "train", "fit", "evaluate", "generate", "report.md", "--quick", "--recipe",
                  f"Default: the recipe {DEFAULT_RECIPE.removesuffix('.yaml')}"):
        assert words in description, words
    text = _flat(demo.format_help())
    assert "retrofit demo --recipe smollm2-135m-hedgehog-fit-cpu" in text
    for action in demo._actions:  # every option says what it does
        assert action.help, action.option_strings
    line = _flat(parser.format_help()).split(" demo ", 1)[1]
    assert line.startswith("a recipe's whole job") and "fit" in line.split(" ls ")[0]


def test_top_level_help_says_where_each_verbs_help_is(capsys):
    from retrofit.cli.main import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = _flat(capsys.readouterr().out)
    assert "retrofit VERB --help for a verb's options" in text
    assert "retrofit VERB COMMAND --help" in text
    assert "retrofit bench SUITE --help" in _flat(_sub(build_parser(), "bench").format_help())
    assert "retrofit eval COMMAND --help" in _flat(_sub(build_parser(), "eval").format_help())


def test_eval_all_documents_its_prefixed_flags():
    from pathlib import Path

    all_parser = _sub(build_parser(), "eval", "all")
    options = [o for action in all_parser._actions for o in action.option_strings]
    flags = {ev.command: [o for o in options if o.startswith(f"--{ev.command}-")] for ev in evaluators()}
    assert "--ppl-lengths" in flags["ppl"] and "--ruler-tasks" in flags["ruler"] and "--passkey-lengths" in flags["passkey"]
    epilog = all_parser.epilog or ""
    readme = (Path(__file__).resolve().parents[2] / "eval" / "README.md").read_text(encoding="utf-8")
    for command, names in flags.items():
        for flag in names:
            assert flag in epilog, flag
            assert f"`{flag}`" in readme, flag
    assert "retrofit eval all --help" in _flat(_sub(build_parser(), "eval").format_help())
