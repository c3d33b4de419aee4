"""What every verb shares: `retrofit ls`, defaults in --help, -q/-v, quiet third-party libraries,
--json summaries, one-line hints for missing extras."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from retrofit.cli.common import _subcommand_parsers
from retrofit.cli.main import build_parser, main
from tests.surgery.tiny import tiny_model, tiny_tokenizer


def _leaves(parser):
    subs = _subcommand_parsers(parser)
    return [parser] if not subs else [leaf for s in subs for leaf in _leaves(s)]


def test_every_verb_has_quiet_verbose_and_shows_defaults():
    parser = build_parser()
    leaves = _leaves(parser)
    assert len(leaves) >= 12  # convert, train, eval x4, generate, bench x3, demo, ls
    for leaf in leaves:
        assert {"-q", "--quiet", "-v", "--verbose"} <= set(leaf._option_string_actions), leaf.prog
    helps = {leaf.prog: " ".join(leaf.format_help().split()) for leaf in leaves}
    assert "(default: 256)" in helps["retrofit convert"]  # --probe-tokens
    assert "(default: 8)" in helps["retrofit eval ppl"]  # --max-windows
    assert "(default: cpu)" in helps["retrofit eval ppl"] and "(default: cpu) (default" not in helps["retrofit eval ppl"]
    assert "prefill only --" in helps["retrofit bench model"]  # --no-train: a flag's default is its absence
    assert not any("(default: True)" in text or "(default: False)" in text for text in helps.values())


def test_ls_lists_each_kind(capsys):
    assert main(["ls"]) == 0
    text = capsys.readouterr().out
    for kind in ("recipes", "convert specs", "datasets", "deepspeed"):
        assert f"\n{kind}  (" in text
    assert main(["ls", "recipes", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [e["name"] for e in data["recipes"]]
    assert "gemma3-270m-macchiato-cpu" in names and not any(n.startswith("convert-") or n == "datasets" for n in names)
    assert main(["ls", "deepspeed", "--json"]) == 0
    assert [e["name"] for e in json.loads(capsys.readouterr().out)["deepspeed"]] == [
        "deepspeed/zero2.json", "deepspeed/zero3.json"]


def test_unknown_recipe_lists_only_recipes(capsys):
    assert main(["train", "nonexistent"]) == 1
    err = capsys.readouterr().err
    assert "gemma3-270m-macchiato-cpu" in err and "convert-macchiato" not in err and "datasets" not in err.split("(")[0]


def test_missing_extra_is_one_line_with_the_pip_command(monkeypatch):
    from retrofit.extras import MissingExtraError, require

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"plots need.*matplotlib: pip install 'retrofit\[eval\]'"):
        require("matplotlib", "plots")
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # an earlier test may have imported it
    with pytest.raises(MissingExtraError, match=r"pip install 'retrofit\[eval\]'"):
        require("lm_eval.tasks", "lm-eval benchmarks")
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'retrofit\[train\]'"):
        require("deepspeed", "retrofit train")


@pytest.mark.slow
def test_convert_json_is_clean_and_quiet(tmp_path):
    """A fresh process, as a user runs it: stdout is exactly one JSON document; no transformers load
    report and no DeepSpeed accelerator notice unless -v."""
    base = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    out = tmp_path / "mac"
    cmd = [sys.executable, "-m", "retrofit.cli.main", "convert", str(base), "--out", str(out), "--window", "8",
           "--latents", "8", "--probe-tokens", "32", "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY",)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["model_type"] == "retrofit_llama" and summary["converted_layers"] == [0, 1]
    assert summary["new_parameters"] > 0 and summary["probe"]["tokens"] == 32 and summary["kind"] == "checkpoint"
    assert summary["retrofit"]["method"] == "macchiato"
    both = proc.stdout + proc.stderr
    assert "Setting accelerator" not in both and "LOAD REPORT" not in both
    assert "converted 2/2 layers" in proc.stderr  # the human lines moved to stderr
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: retrofit") and "retrofit_llama" in card and str(out) in card
