"""The hostile re-test, continued: eval flags and output folders, training data beside its output,
lm-eval on a CPU-only machine, and the small convert cases; each on a tiny random model.

Every refusal is one ``error:`` line (exit 1, no traceback), raised before any model loads where
the inputs already tell; no input file changes; nothing partial is left.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from retrofit.cli.main import main
from tests.reliability.test_faults import convert_argv, fails, leftovers, recipe_file, snapshot
from tests.train import tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test's expectations (the refusal must come first)."""
    from retrofit.eval import loading

    def refuse(*args, **kwargs):
        raise RuntimeError("a model was loaded before the flags were checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def _ppl(model, *extra) -> list[str]:
    return ["eval", "ppl", str(model), "--lengths", "8", "--datasets", "pg-books", "--max-windows", "1", "--quiet",
            *extra]


# ---------------------------------------------------------------------- harness flags lm-eval rejects late
@pytest.mark.parametrize("flags, needles", [
    (["--limit", "0"], ["--limit 0 selects no examples", "--limit 100"]),
    (["--limit", "-3"], ["--limit -3 selects no examples"]),
    (["--limit", "2.5"], ["whole number"]),
    (["--num-fewshot", "1000000"], ["--num-fewshot 1000000", "at most 1000"]),
    (["--num-fewshot", "4"], ["few-shot pool has 4 examples", "--num-fewshot 3 or less"]),
    (["--num-fewshot", "retrofit_tiny_mc=9"], ["few-shot pool has 4 examples"]),
    (["--batch-size", "0"], ["--batch-size must be >= 1"]),
    (["--max-length", "0"], ["--max-length must be >= 1"]),
    (["--bootstrap-iters", "-1"], ["--bootstrap-iters must be >= 0"]),
])
def test_harness_limit_and_fewshot_fail_before_any_model_loads(base, tmp_path, capsys, no_model_loads, flags, needles):
    before = snapshot(base)
    out = tmp_path / "out"
    fails(["eval", "harness", str(base), "--tasks", "retrofit_tiny_mc", "--out", str(out), *flags], capsys, *needles)
    assert not out.exists() and snapshot(base) == before


# ---------------------------------------------------------------------- eval --out
def test_eval_out_unwritable_fails_before_any_model_loads(base, tmp_path, capsys, no_model_loads):
    fails(_ppl(base, "--out", "/proc/retrofit-no-such-folder/out"), capsys, "cannot be written", "writable")
    if os.geteuid() != 0:  # root writes through permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            fails(_ppl(base, "--out", str(ro / "out")), capsys, "cannot be written")
            assert not list(ro.iterdir())
        finally:
            ro.chmod(0o700)


def test_eval_out_never_writes_into_a_model_folder(base, tmp_path, capsys, no_model_loads):
    before = snapshot(base)
    fails(_ppl(base, "--out", str(base)), capsys, "model folder", "elsewhere")
    fails(_ppl(base, "--out", str(base), "--overwrite"), capsys, "model folder")
    fails(_ppl(base, "--out", str(base / "eval")), capsys, "lies inside the model folder")
    other = tmp_path / "other-model"  # a model folder that is not an input of this eval
    other.mkdir()
    (other / "config.json").write_text("{}")
    fails(_ppl(base, "--out", str(other), "--overwrite"), capsys, "holds a model", "config.json")
    assert snapshot(base) == before and not (base / "eval").exists()
    assert sorted(p.name for p in other.iterdir()) == ["config.json"]


def test_eval_out_keeps_earlier_results_unless_overwrite(base, tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "results.json").write_text('{"mine": 1}\n')
    (out / "table.md").write_text("| a table I need |\n")
    (out / "notes.txt").write_text("precious\n")
    before = snapshot(out)
    fails(_ppl(base, "--out", str(out)), capsys, "already holds results", "--overwrite")
    assert snapshot(out) == before
    report = tmp_path / "report"  # eval all's folder: results one level down
    (report / "ppl").mkdir(parents=True)
    (report / "ppl" / "results.json").write_text("{}\n")
    fails(["eval", "all", str(base), "--out", str(report)], capsys, "already holds results", "ppl/results.json")
    assert main(_ppl(base, "--out", str(out), "--overwrite")) == 0
    capsys.readouterr()
    assert json.loads((out / "results.json").read_text())["kind"] == "perplexity"
    assert (out / "notes.txt").read_text() == "precious\n" and not leftovers(tmp_path)


def test_the_default_eval_folder_moves_on_instead_of_overwriting(base, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "runs" / "eval" / base.name / "ppl"
    assert main(_ppl(base)) == 0
    before = snapshot(first)
    assert main(_ppl(base, "--lengths", "16")) == 0
    assert f"wrote {Path('runs/eval') / base.name / 'ppl-2'}/results.json" in capsys.readouterr().out
    assert snapshot(first) == before
    assert json.loads((first.parent / "ppl-2" / "results.json").read_text())["settings"]["lengths"] == [16]


# ---------------------------------------------------------------------- training data beside its output
def test_an_empty_eval_file_is_refused_before_any_model_loads(base, books, tmp_path, capsys):
    recipe = recipe_file(tmp_path, base, books)
    empty = tmp_path / "eval.jsonl"
    empty.write_text("\n\n")
    fails(["train", str(recipe), f"eval.files={empty}"], capsys, "held-out (eval) files hold no text",
          "eval.sequences=0")
    assert not (tmp_path / "out").exists()


def test_an_eval_file_shorter_than_one_sequence_fails_before_step_1(base, books, tmp_path, capsys):
    recipe = recipe_file(tmp_path, base, books)
    short = tmp_path / "eval.txt"
    short.write_text("a few words\n")
    fails(["train", str(recipe), f"eval.files={short}"], capsys, "fewer than data.seq_len=32 tokens",
          "eval.sequences=0")
    assert not (tmp_path / "out" / "metrics.jsonl").exists() and not list((tmp_path / "out").glob("checkpoint-*"))
    assert not leftovers(tmp_path)


def test_an_output_dir_in_the_data_folder_is_refused_at_validation(base, books, tmp_path, capsys):
    before = snapshot(books)
    recipe = recipe_file(tmp_path, base, books)
    fails(["train", str(recipe), f"checkpoint.output_dir={books}"], capsys,
          "checkpoint.output_dir", "is the data.files folder", "outside the data")
    fails(["train", str(recipe), f"checkpoint.output_dir={books / 'run'}"], capsys, "lies inside the data.files folder")
    fails(["train", str(recipe), f"data.files={books}/*.txt", f"checkpoint.output_dir={books}"], capsys,
          "is the data.files folder")
    fails(["train", str(recipe), f"eval.files={books}", f"checkpoint.output_dir={books}"], capsys, "data.files folder")
    assert snapshot(books) == before and not (books / "run").exists()


# ---------------------------------------------------------------------- retrofit-lm-eval on a CPU-only machine
@pytest.fixture
def _reset_accelerate():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def test_lm_eval_retrofit_model_loads_on_the_cpu_without_cuda(base, monkeypatch, _reset_accelerate):
    """lm-eval's CLI passes device cuda:0 unless told otherwise; without CUDA the model loads on the CPU."""
    import torch
    from lm_eval.api.registry import get_model

    import retrofit.eval  # noqa: F401  (registers the `retrofit` model)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # "cuda:0": what `retrofit-lm-eval run` passes without --device (lm-eval's EvaluatorConfig default)
    lm = get_model("retrofit").create_from_arg_string(f"pretrained={base}", {"batch_size": 1, "device": "cuda:0"})
    assert lm.device.type == "cpu" and next(lm.model.parameters()).device.type == "cpu"


@pytest.mark.slow
def test_lm_eval_cli_runs_the_retrofit_model_without_cuda(base, monkeypatch, capsys, _reset_accelerate):
    """The command eval/README.md shows, end to end, on a machine without CUDA."""
    import torch

    from retrofit.eval import lm_eval_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lm_eval_cli.main(["run", "--model", "retrofit", "--model_args", f"pretrained={base}",
                      "--tasks", "retrofit_tiny_mc", "--limit", "2"])
    out = capsys.readouterr().out
    assert "retrofit_tiny_mc" in out and "acc" in out


def test_lm_eval_retrofit_model_device_resolution(monkeypatch):
    import torch

    from retrofit.eval.lm_model import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == resolve_device("cuda:0") == resolve_device("cuda") == "cpu"
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == "cuda" and resolve_device("cuda:1") == "cuda:1"


# ---------------------------------------------------------------------- convert: the small ones
def test_rope_cap_with_no_full_attention_layer_left_warns(base, tmp_path, capsys):
    assert main(convert_argv(base, tmp_path / "out", "--rope-cap", "100", "-q")) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "--rope-cap 100 has no effect" in warnings[0], err
    assert "Traceback" not in err


def test_probe_tokens_zero_under_rank_layers_and_beyond_the_positions_are_refused(base, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    fails(["convert", str(base), "--out", str(out), "--rank-layers", "--probe-tokens", "0"], capsys,
          "--probe-tokens 0", "64 or more")
    fails(["convert", str(base), "--out", str(out), "--keep-full", "1", "--probe-tokens", "0"], capsys, "--keep-full")
    fails(["convert", str(base), "--out", str(out), "--probe-tokens", "-5"], capsys, "must be >= 0")
    from retrofit.surgery import probe

    def no_probe(*args, **kwargs):
        raise RuntimeError("the probe ran")

    monkeypatch.setattr(probe, "probe_ids", no_probe)
    fails(["convert", str(base), "--out", str(out), "--window", "8", "--probe-tokens", "5000"], capsys,
          "--probe-tokens 5000 exceeds the model's max_position_embeddings=1024", "--probe-tokens 1024 or less")
    assert not out.exists() and not leftovers(tmp_path)


def test_the_default_probe_fits_a_model_with_few_positions(tmp_path, capsys):
    short = tiny.save_base(tmp_path / "short")
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 128
    (short / "config.json").write_text(json.dumps(cfg))
    assert main(["convert", str(short), "--out", str(tmp_path / "out"), "--window", "8", "--latents", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["probe"]["tokens"] == 128


def test_the_convert_log_prints_the_window_the_checkpoint_records(base, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(base), "--out", str(out), "--latents", "8", "--probe-tokens", "0"]) == 0
    log = capsys.readouterr().out
    window = json.loads((out / "config.json").read_text())["retrofit"]["window"]
    assert isinstance(window, int) and f"window={window}," in log and "window=None" not in log


def test_the_card_names_a_local_base_by_absolute_path_like_its_load_snippet(base, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(base.parent)
    out = tmp_path / "out"
    assert main(convert_argv(base.name, os.path.relpath(out), "-q")) == 0
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == str(base.resolve())
    assert f'from_pretrained("{out.resolve()}")' in card


def test_the_readme_says_an_explicit_family_class_loads_the_base(base, tmp_path, capsys):
    readme = (REPO / "README.md").read_text()
    assert "`LlamaForCausalLM.from_pretrained(folder)`" in readme and "loads the base model" in readme
    out = tmp_path / "out"
    assert main(convert_argv(base, out, "-q")) == 0
    from transformers import LlamaForCausalLM

    import retrofit  # noqa: F401  (registered, and still the family class loads the base)

    model = LlamaForCausalLM.from_pretrained(out)
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
