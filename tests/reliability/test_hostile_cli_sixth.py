"""The hostile re-test, sixth pass: YAML that PyYAML fails on with other exceptions, an allocation the machine
cannot make, a config.json that is not UTF-8, a seed numpy refuses, a corrupt Parquet file, a YAML false given
to a string key, and an output folder where no file can be made; then eval all's too-short passkey length, a
config.json of absurd sizes, convert's --rank-layers with --keep-full and a YAML key given twice; each on a tiny
random model.

Every refusal is one ``error:`` line (exit 1, no traceback) that says what to change, and writes nothing.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from retrofit.cli.main import main
from tests.reliability.test_faults import fails, leftovers, recipe_file, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

DEEP = "[" * 3000 + "]" * 3000  # deeper than Python's recursion limit: PyYAML raised RecursionError
LONG_INT = "1" + "0" * 5000  # past int_max_str_digits: PyYAML raised ValueError


# ---------------------------------------------------------------------- 1. YAML that is no YAML value
@pytest.mark.parametrize("text, needle", [(f"train: {DEEP}\n", "nested too deeply"),
                                          (f"train:\n  max_steps: {LONG_INT}\n", "4300 digits")])
def test_a_recipe_nested_too_deeply_or_with_a_huge_integer_is_bad_yaml(base, books, tmp_path, capsys, text, needle):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    fails(["train", str(recipe)], capsys, f"recipe {recipe} is not valid YAML", needle)
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("value, needle", [(DEEP, "nested too deeply"), (LONG_INT, "4300 digits")])
def test_convert_options_and_configs_nested_too_deeply_or_huge_are_bad_yaml(base, tmp_path, capsys, value, needle):
    out = tmp_path / "o"
    fails(["convert", str(base), "--out", str(out), "--option", f"window={value}"], capsys,
          "--option window:", "is not a plain YAML value", needle)
    config = tmp_path / "spec.yaml"
    config.write_text(f"method: macchiato\nwindow: {value}\n")
    fails(["convert", str(base), "--out", str(out), "--config", str(config)], capsys, f"{config} is not valid YAML",
          needle)
    assert not out.exists()


def test_an_override_nested_too_deeply_is_a_refused_value_not_a_traceback(base, books, tmp_path, capsys):
    recipe = recipe_file(tmp_path, base, books)
    fails(["train", str(recipe), f"train.betas={DEEP}"], capsys, "train.betas must be two numbers")
    fails(["train", str(recipe), f"train.max_steps={LONG_INT}"], capsys, "train.max_steps must be an integer")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- 2. an allocation the machine cannot make
def test_an_allocation_the_machine_cannot_make_is_one_error_line(base, tmp_path, capsys):
    # hedgehog --features 99999999 asked for 25 GB while building layer 0: a RuntimeError traceback
    out = tmp_path / "o"
    fails(["convert", str(base), "--out", str(out), "--method", "hedgehog", "--features", "99999999",
           "--probe-tokens", "0"], capsys, "out of memory: DefaultCPUAllocator: can't allocate memory",
          "give smaller sizes")
    assert not out.exists() and not leftovers(tmp_path)


def test_a_memory_error_anywhere_reads_the_same(base, tmp_path, capsys, monkeypatch):
    from retrofit import surgery

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(surgery, "load_any", no_memory)
    fails(["convert", str(base), "--out", str(tmp_path / "o")], capsys, "out of memory: MemoryError")


# ---------------------------------------------------------------------- 3. a config.json that is not UTF-8
@pytest.mark.parametrize("verb", ["convert", "generate"])
def test_a_config_json_that_is_not_utf8_says_so(base, tmp_path, capsys, verb):
    model = tmp_path / "model"
    shutil.copytree(base, model)
    (model / "config.json").write_bytes(b"\xff\xfe" + (base / "config.json").read_bytes())
    before = snapshot(model)
    argv = {"convert": ["convert", str(model), "--out", str(tmp_path / "o")],
            "generate": ["generate", str(model), "--prompt", "hi"]}[verb]
    fails(argv, capsys, f"cannot read {model / 'config.json'}: not UTF-8 text (byte 0: 0xff)", "save it again as UTF-8")
    assert snapshot(model) == before and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------- 4. a seed numpy refuses
@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999999"])
def test_a_training_seed_numpy_refuses_is_named_before_the_run(base, books, tmp_path, capsys, seed):
    # numpy's "Seed must be between 0 and 2**32 - 1" came out of set_seed as a traceback
    recipe = recipe_file(tmp_path, base, books)
    fails(["train", str(recipe), f"train.seed={seed}"], capsys, f"train.seed must be a whole number from 0 to 2**32 - 1, "
          f"got {seed}")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------- 5. a corrupt Parquet file
@pytest.mark.parametrize("verb", ["train", "fit"])
def test_a_corrupt_parquet_file_is_named(base, books, tmp_path, capsys, verb):
    # pyarrow's ArrowInvalid came out of the streamed dataset's first read as a traceback
    bad = tmp_path / "data" / "x.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1 not really parquet")
    conversion = {"conversion": {"method": "hedgehog", "window": 8, "sinks": 2, "features": 8,
                                 "memory_distance": 8}} if verb == "fit" else {}
    recipe = recipe_file(tmp_path, base, bad, **conversion)
    argv = [verb, str(recipe)] + (["--out", str(tmp_path / "fitted")] if verb == "fit" else [])
    fails(argv, capsys, f"{bad}: not a readable Parquet file", "leave it out of the data files")
    assert not (tmp_path / "out").exists() and not (tmp_path / "fitted").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------- 6. YAML's false given to a string key
@pytest.mark.parametrize("word", ["no", "false", "off"])
def test_a_yaml_false_given_to_a_string_key_is_not_taken_as_the_word_false(base, books, tmp_path, capsys, word):
    # checkpoint.resume=no looked for a checkpoint folder named 'False'
    recipe = recipe_file(tmp_path, base, books)
    line = fails(["train", str(recipe), f"checkpoint.resume={word}"], capsys, "checkpoint.resume must be a string, "
                 "got false", "quote the word")
    assert "False is not a complete training checkpoint" not in line


# ---------------------------------------------------------------------- 7. an output folder where no file can be made
def test_an_output_where_no_file_can_be_made_is_not_blamed_on_other_runs(base, capsys):
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc")
    line = fails(["convert", str(base), "--out", "/proc/retrofit-out"], capsys, "no file can be made in /proc",
                 "choose a writable output folder")
    assert "other runs" not in line


# ---------------------------------------------------------------------- 8. eval all: a passkey length too short
def test_eval_all_refuses_a_too_short_passkey_length_before_its_first_part(base, books, tmp_path, capsys,
                                                                          monkeypatch):
    # the length needs the tokenizer: it was refused by the passkey part, after the perplexity part's run and results
    import retrofit.eval.perplexity as perplexity

    started = []
    real = perplexity.run_perplexity
    monkeypatch.setattr(perplexity, "run_perplexity", lambda *a, **k: started.append(1) or real(*a, **k))
    out = tmp_path / "all"
    fails(["eval", "all", str(base), "--passkey-lengths", "16", "--ppl-lengths", "16", "--datasets", str(books),
           "--haystack", "noise", "--skip", "harness", "niah", "ruler", "--out", str(out)], capsys,
          "passkey length 16 is too short: the instructions alone take")
    assert not started and not (out / "ppl").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------- 9. a config.json of absurd sizes
@pytest.mark.parametrize("key, value", [("num_hidden_layers", 1_000_000_000), ("vocab_size", 10**15)])
@pytest.mark.parametrize("verb", ["convert", "generate", "eval"])
def test_a_config_json_of_absurd_sizes_is_refused_before_the_build(base, tmp_path, capsys, verb, key, value):
    # transformers built num_hidden_layers: 1000000000 layer by layer until killed
    import json

    model = tmp_path / "model"
    shutil.copytree(base, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    before = snapshot(model)
    argv = {"convert": ["convert", str(model), "--out", str(tmp_path / "o")],
            "generate": ["generate", str(model), "--prompt", "hi"],
            "eval": ["eval", "ppl", str(model), "--out", str(tmp_path / "o")]}[verb]
    fails(argv, capsys, f"{model / 'config.json'} describes a model this machine cannot hold", f"{key}={value}",
          "check the sizes in config.json")
    assert snapshot(model) == before and not (tmp_path / "o").exists()


def test_a_config_json_of_ordinary_sizes_passes_the_size_check(base, monkeypatch):
    from retrofit.errors import CheckpointError
    from retrofit.surgery import sources

    sources.check_model_size(base, sources.read_config(base))  # the tiny model
    monkeypatch.setattr(sources, "machine_bytes", lambda: 32 * 2**30)
    eight_b = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256}
    sources.check_model_size(base, eight_b)  # 16 GB at bf16
    with pytest.raises(CheckpointError, match="cannot hold"):
        sources.check_model_size(base, {**eight_b, "num_hidden_layers": 320})


# ---------------------------------------------------------------------- 10. convert --rank-layers with --keep-full
def test_rank_layers_with_keep_full_is_refused_not_half_ignored(base, tmp_path, capsys):
    # --keep-full 1 converted and saved, and --rank-layers (rank only, save nothing) was silently dropped
    out = tmp_path / "o"
    fails(["convert", str(base), "--out", str(out), "--rank-layers", "--keep-full", "1"], capsys,
          "--rank-layers and --keep-full 1 contradict each other", "pass one of them")
    assert not out.exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------- 11. a key given twice in YAML
def test_a_recipe_with_a_section_given_twice_is_refused(base, books, tmp_path, capsys):
    # a second train: section replaced the first, silently
    recipe = recipe_file(tmp_path, base, books)
    lines = recipe.read_text().splitlines()
    recipe.write_text("\n".join(lines) + "\ntrain:\n  max_steps: 1\n")
    first = lines.index("train:") + 1
    fails(["train", str(recipe)], capsys, f"recipe {recipe} is not valid YAML",
          f"key 'train' is given twice (lines {first} and {len(lines) + 1}): give each key once")
    assert not (tmp_path / "out").exists()


def test_a_key_given_twice_in_a_config_option_or_override_is_refused(base, books, tmp_path, capsys):
    out = tmp_path / "o"
    config = tmp_path / "spec.yaml"
    config.write_text("method: macchiato\nwindow: 8\nwindow: 16\n")
    fails(["convert", str(base), "--out", str(out), "--config", str(config)], capsys, f"{config} is not valid YAML",
          "key 'window' is given twice (lines 2 and 3)")
    fails(["convert", str(base), "--out", str(out), "--option", "window={a: 1, a: 2}"], capsys,
          "--option window:", "key 'a' is given twice (line 1)")
    assert not out.exists()
    recipe = recipe_file(tmp_path, base, books)
    fails(["train", str(recipe), "conversion={window: 8, window: 16}"], capsys,
          "override 'conversion={window: 8, window: 16}': key 'window' is given twice")
    assert not (tmp_path / "out").exists()
