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


# ---------------------------------------------------------------------- 1. sizes that never end
@pytest.mark.parametrize("value", HUGE)
def test_generate_refuses_max_new_tokens_no_run_reaches_before_the_model_loads(base, capsys, no_model_loads, value):
    # a model that never says end-of-sequence generated until the process was killed
    fails(["generate", str(base), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", value], capsys,
          f"--max-new-tokens {value}", "at most 1048576")


@pytest.mark.parametrize("command, flags, flag", [
    ("niah", ["--max-new-tokens"], "--max-new-tokens"),
    ("ruler", ["--max-new-tokens"], "--max-new-tokens"),
    ("harness", ["--gen-max-new-tokens"], "--gen-max-new-tokens"),
    ("all", ["--niah-max-new-tokens"], "--niah-max-new-tokens"),
    ("all", ["--ruler-max-new-tokens"], "--ruler-max-new-tokens"),
])
def test_eval_refuses_a_generation_bound_no_run_reaches_before_any_model_loads(base, tmp_path, capsys, no_model_loads,
                                                                              command, flags, flag):
    out = tmp_path / "o"
    fails(["eval", command, str(base), "--out", str(out), *flags, HUGE[1]], capsys, f"{flag} {HUGE[1]}",
          "at most 1048576")
    assert not out.exists()


def test_bench_decode_refuses_more_timed_steps_than_any_run_takes(tmp_path, capsys, no_run):
    out = tmp_path / "b"
    fails(["bench", "decode", "--new-tokens", "2000000", "--out", str(out)], capsys, "--new-tokens 2000000",
          "at most 1048576")
    assert not out.exists()


def test_the_bounds_are_in_the_flags_help(capsys):
    for argv in (["generate", "--help"], ["eval", "niah", "--help"], ["bench", "decode", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "1048576" in capsys.readouterr().out, argv


@pytest.mark.parametrize("verb", ["train", "fit"])
@pytest.mark.parametrize("override, needles", [
    (f"train.max_steps={HUGE[0]}", [f"train.max_steps={HUGE[0]}", "at most 100,000,000", "train.max_time"]),
    (f"train.max_steps={HUGE[1]}", [f"train.max_steps={HUGE[1]}", "at most 100,000,000"]),
    (f"train.max_tokens={HUGE[0]}", [f"train.max_tokens={HUGE[0]}", "at most 12,800,000,000 tokens"]),
    ("fit.maps.steps=10000000000", ["fit.maps.steps=10000000000", "at most 100,000,000"]),
])
def test_a_recipe_with_steps_no_run_finishes_is_refused_before_anything_loads(base, books, tmp_path, capsys, no_run,
                                                                              verb, override, needles):
    # train.max_steps=1e12 trained (and checkpointed) until the process was killed
    recipe = recipe_file(tmp_path, base, books)
    extra = ["train.max_steps=null"] if "max_tokens" in override else []
    fails([verb, str(recipe), *extra, override], capsys, *needles)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_a_stage_with_steps_no_run_finishes_is_named(base, books, tmp_path, capsys, no_run):
    recipe = recipe_file(tmp_path, base, books, stages=[{"name": "a", "train": {"max_steps": 2}},
                                                        {"name": "b", "train": {"max_steps": 10**12}}])
    fails(["train", str(recipe)], capsys, "stages[1] (b)", "train.max_steps=1000000000000")


def test_the_step_bound_leaves_real_recipes_alone(base, books, tmp_path):
    from retrofit.train.recipe import MAX_STEPS, load_recipe

    recipe = recipe_file(tmp_path, base, books)
    assert load_recipe(str(recipe), [f"train.max_steps={MAX_STEPS}"]).train.max_steps == MAX_STEPS
    assert load_recipe(str(recipe), ["train.max_steps=null", "train.max_tokens=20000000"]).train.max_tokens


# ---------------------------------------------------------------------- 2. an output inside its input
@pytest.mark.parametrize("inside", ["conv", "a/b/conv"])
def test_convert_never_writes_into_its_input_folder(base, tmp_path, capsys, inside):
    model = tmp_path / "model"
    shutil.copytree(base, model)
    before = snapshot(model)
    for extra in ([], ["--delta"], ["--overwrite"]):
        fails(["convert", str(model), "--out", str(model / inside), "--window", "8", "--latents", "8",
               "--probe-tokens", "0", *extra], capsys, f"lies inside the input {model}", "outside the input folder")
    assert snapshot(model) == before and not leftovers(tmp_path)
    assert sorted(p.name for p in model.iterdir()) == sorted(p.name for p in base.iterdir())


def test_fit_never_writes_into_its_input_folder(base, books, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(base, model)
    before = snapshot(model)
    recipe = recipe_file(tmp_path, model, books, conversion=HEDGEHOG)
    fails(["fit", str(recipe), "--out", str(model / "fitted")], capsys, f"lies inside the input {model}")
    assert snapshot(model) == before and not leftovers(tmp_path)


def test_an_output_beside_its_input_or_in_the_current_folder_is_still_written(base, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an output inside the current folder is the usual case
    assert main(["convert", str(base), "--out", "runs/conv", "--window", "8", "--latents", "8", "--probe-tokens",
                 "0", "-q"]) == 0, capsys.readouterr().err
    assert (tmp_path / "runs" / "conv" / "config.json").is_file()


# ---------------------------------------------------------------------- 3. a plugin that raises while converting
PLUGIN = textwrap.dedent('''
    """A conversion-method plugin whose builder raises, and one whose layer raises while the probe runs."""
    from retrofit.layers import RetrofitAttention
    from retrofit.layers.cache import RetrofitLayerCache
    from retrofit.layers.method import register_method


    def build_broken(original, patch, spec, layer_idx, generator):
        raise RuntimeError(f"cannot build layer {layer_idx}\\nwith a second line")


    register_method("plug-build", build_broken, options={"gain": 1.0}, description="raises while building")


    class Fizzle(RetrofitAttention):
        method = "plug-attend"
        new_module_names = ()

        def new_cache_layer(self):
            return RetrofitLayerCache()

        def attend(self, q, k, v, valid, cache, **kwargs):
            raise KeyError("fizzled")


    def build_fizzle(original, patch, spec, layer_idx, generator):
        return Fizzle(original, patch)


    register_method("plug-attend", build_fizzle, options={"gain": 1.0}, description="raises in attend")
''')


@pytest.fixture
def raising_plugin(tmp_path, monkeypatch):
    """PLUGIN named in the retrofit.methods entry-point group of a fresh process."""
    from retrofit import plugins
    from retrofit.layers import method as registry

    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "raising_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(folder))

    def entry_points(*, group: str):
        if group != "retrofit.methods":
            return []
        return [metadata.EntryPoint(name="raising", value="raising_plugin", group=group)]

    registry._FOUND.everything()
    monkeypatch.setattr(plugins.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry._FOUND, "_done", registry._FOUND._done - {"entry points"})
    monkeypatch.setattr(plugins, "_LOADED", {})
    yield
    for name in ("plug-build", "plug-attend"):
        registry._METHODS.pop(name, None)
    sys.modules.pop("raising_plugin", None)


@pytest.mark.parametrize("method, needles", [
    ("plug-build", ["raising_plugin.build_broken()", "RuntimeError: cannot build layer 0 with a second line"]),
    ("plug-attend", ["raising_plugin.Fizzle.attend()", "KeyError: 'fizzled'"]),
])
def test_a_plugin_method_that_raises_while_converting_is_one_line_naming_it(base, tmp_path, capsys, raising_plugin,
                                                                           method, needles):
    # its exception came out as a traceback through retrofit's code, as if retrofit had failed
    out = tmp_path / "out"
    fails(["convert", str(base), "--out", str(out), "--method", method, "--probe-tokens", "16"], capsys,
          "the plugin raising_plugin (retrofit.methods entry point 'raising')", *needles, "fix or update the plugin")
    assert not out.exists() and not leftovers(tmp_path)


def test_retrofits_own_failures_still_show_their_traceback(base, tmp_path, monkeypatch, raising_plugin):
    # a plugin being installed does not make every bug of retrofit's the plugin's
    from retrofit import surgery

    def broken(*args, **kwargs):
        raise ZeroDivisionError("retrofit's own bug")

    monkeypatch.setattr(surgery, "load_any", broken)
    with pytest.raises(ZeroDivisionError):
        main(["convert", str(base), "--out", str(tmp_path / "o"), "--method", "plug-attend"])


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


# ---------------------------------------------------------------------- 5. paths that are there but no file
def _special(tmp_path: Path) -> list[str]:
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    dangling = tmp_path / "gone.txt"
    dangling.symlink_to(tmp_path / "removed.txt")
    return [os.devnull, str(fifo), str(dangling)]


def _kind(path: str) -> str:
    return {"pipe.txt": "a named pipe (FIFO)", "gone.txt": "a symbolic link"}.get(Path(path).name,
                                                                                "a character device")


@pytest.mark.parametrize("verb", ["train", "fit"])
def test_a_training_data_path_that_is_no_file_says_what_it_is(base, books, tmp_path, capsys, verb):
    # /dev/null was reported as "data file /dev/null does not exist"
    recipe = recipe_file(tmp_path, base, books, **({"conversion": HEDGEHOG} if verb == "fit" else {}))
    for path in _special(tmp_path):
        line = fails([verb, str(recipe), f"data.files={path}"], capsys, f"data file {path} is {_kind(path)}",
                     ".txt/.jsonl/.json/.parquet files or a folder")
        assert "does not exist" not in line or "symbolic link" in line, line
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("command, flag", [("ppl", "--datasets"), ("passkey", "--haystack"), ("niah", "--haystack"),
                                           ("all", "--ruler-haystack")])
def test_an_eval_text_path_that_is_no_file_fails_before_any_model_loads(base, tmp_path, capsys, no_model_loads,
                                                                       command, flag):
    # eval ppl --datasets /dev/null loaded both models, then said "no .txt/.jsonl/.json files under /dev/null"
    for path in _special(tmp_path)[:2]:
        fails(["eval", command, str(base), "--out", str(tmp_path / "o"), flag, path], capsys,
              f"{flag} {path} is {_kind(path)}", "retrofit ls datasets")
        os.unlink(path) if path != os.devnull else None
    assert not (tmp_path / "o").exists()


def test_the_corpus_api_says_what_a_path_is(tmp_path):
    from retrofit.errors import DataError
    from retrofit.eval.corpora import resolve_corpus

    with pytest.raises(DataError, match="is a character device, not a regular file"):
        resolve_corpus(os.devnull)


@pytest.mark.parametrize("argv", [
    ["convert", os.devnull, "--out", "o"],
    ["generate", os.devnull, "--prompt", "hi"],
    ["train", os.devnull],
    ["convert", "MODEL", "--out", "o", "--config", os.devnull],
])
def test_a_model_recipe_or_config_that_is_a_device_says_so(base, tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    argv = [str(base) if a == "MODEL" else a for a in argv]
    line = fails(argv, capsys, os.devnull, "is a character device, not a regular file")
    assert "does not exist" not in line and "not found" not in line, line
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------- 6. a bench that measures nothing
def test_a_bench_whose_every_point_times_out_fails_and_writes_nothing(tmp_path, capsys):
    # exit 0 with a table of "timed out" rows: a worker's start alone takes longer than 0.01 s
    out = tmp_path / "b"
    fails(["bench", "attention", "--lengths", "64", "--ops", "latte", "--modes", "fwd", "--heads", "2", "--head-dim",
           "8", "--repeats", "1", "--point-timeout", "0.01", "--quiet", "--out", str(out)], capsys,
          "no point finished within --point-timeout 0.01 s", "larger --point-timeout")
    assert not out.exists() and not leftovers(tmp_path)


def test_a_bench_whose_every_point_fails_names_the_first_failure(tmp_path, capsys, monkeypatch):
    from retrofit.bench import attention

    def fail(payload):
        raise RuntimeError("out of memory\nat the largest length")

    monkeypatch.setattr(attention, "measure_point", fail)
    out = tmp_path / "b"
    fails(["bench", "attention", "--lengths", "64", "128", "--ops", "latte", "--modes", "fwd", "--heads", "2",
           "--head-dim", "8", "--no-isolate", "--quiet", "--out", str(out)], capsys,
          "no point was measured: latte at T=64 failed: out of memory", "(and 1 more points)")
    assert not out.exists()
