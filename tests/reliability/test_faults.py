"""Fault injection: each fault case (a bad input, a full disk, a crash mid-write, ...) reproduced on tiny models.

Every case asserts the clear refusal (one ``error:`` line, exit 1, no traceback), that no input
file changed, and that nothing partial (temporary folders, locks, half checkpoints) remains.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from retrofit.cli.main import main
from retrofit.errors import CheckpointError, DataError
from tests.train import tiny

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- helpers
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots`` (what 'no input file changed' compares)."""
    out = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


_PARTIAL = (".tmp-", ".old-", ".gguf-", ".trash-", ".lock")


def leftovers(*folders: Path) -> list[str]:
    """Temporary folders, trash and lock files left anywhere under ``folders``."""
    found = []
    for folder in folders:
        if folder.is_dir():
            found += [str(p) for p in folder.rglob(".*") if any(t in p.name for t in _PARTIAL)]
    return found


def fails(argv: list[str], capsys, *needles: str) -> str:
    """``retrofit ARGV`` exits 1 with exactly one ``error:`` line containing ``needles`` and no traceback."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert rc == 1, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def convert_argv(model, out, *extra) -> list[str]:
    return ["convert", str(model), "--out", str(out), "--window", "8", "--latents", "8", "--probe-tokens", "0", *extra]


def recipe_file(tmp_path: Path, model: Path, data: Path, **sections) -> Path:
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny.recipe_dict(model, data, tmp_path / "out", **sections)))
    return path


# ---------------------------------------------------------------------- 1. data loss through --overwrite
def test_1_delta_never_overwrites_its_own_base(base, tmp_path, capsys):
    model = tmp_path / "m"
    shutil.copytree(base, model)
    before = snapshot(model)
    fails(convert_argv(model, model, "--delta", "--overwrite"), capsys, "is the input")
    assert snapshot(model) == before and not leftovers(tmp_path)
    # the library refuses too, even without the CLI's input check
    from retrofit import surgery

    m, _ = surgery.load_any(model)
    surgery.convert(m, surgery.ConversionSpec(window=8, latents=8))
    with pytest.raises(CheckpointError, match="is the input"):
        surgery.save_delta(m, model, overwrite=True)
    assert snapshot(model) == before and not leftovers(tmp_path)


def test_1_overwrite_never_deletes_a_folder_holding_the_input_or_the_cwd(base, tmp_path, capsys, monkeypatch):
    proj = tmp_path / "x" / "proj"
    shutil.copytree(base, proj / "llama")
    (proj / "notes.txt").write_text("unrelated")
    before = snapshot(tmp_path / "x")
    monkeypatch.chdir(tmp_path / "x")
    fails(convert_argv("proj/llama", "proj", "--overwrite"), capsys, "contains the input proj/llama")
    fails(convert_argv("proj/llama", ".", "--overwrite"), capsys, "the current directory")
    fails(convert_argv("proj/llama", "..", "--overwrite"), capsys, "contains the current directory")
    assert snapshot(tmp_path / "x") == before and not leftovers(tmp_path)
    # an existing folder that is not a checkpoint is never replaced
    other = tmp_path / "x" / "other"
    other.mkdir()
    (other / "data.csv").write_text("1,2\n")
    fails(convert_argv("proj/llama", "other", "--overwrite"), capsys, "not a checkpoint folder", "data.csv")
    assert (other / "data.csv").read_text() == "1,2\n"
    # while a checkpoint it wrote is replaced
    assert main(convert_argv("proj/llama", "out")) == 0
    assert main(convert_argv("proj/llama", "out", "--overwrite", "--window", "4")) == 0
    assert json.loads((tmp_path / "x" / "out" / "config.json").read_text())["retrofit"]["window"] == 4
    assert snapshot(tmp_path / "x" / "proj") == {k: v for k, v in before.items() if "/proj/" in k}
    assert not leftovers(tmp_path)


# ---------------------------------------------------------------------- 2 + 5. resume: no code, same base
def _train(recipe: Path, *overrides: str) -> int:
    return main(["train", str(recipe), *overrides])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base, books):
    """A 1-step run with its checkpoint-1 (the base is a private copy the tests may alter)."""
    root = tmp_path_factory.mktemp("trained")
    model = root / "llama"
    shutil.copytree(base, model)
    recipe = recipe_file(root, model, books, train={"max_steps": 1}, checkpoint={"save_every": 1, "export": False},
                         eval={"sequences": 0})
    assert _train(recipe) == 0
    assert (root / "out" / "checkpoint-1" / "trainer_state.json").is_file()
    return root, recipe


def _fresh_copy(trained, tmp_path) -> tuple[Path, Path]:
    root, recipe = trained
    shutil.copytree(root / "out", tmp_path / "out")
    text = recipe.read_text().replace(str(root / "out"), str(tmp_path / "out"))
    (tmp_path / "recipe.yaml").write_text(text)
    return tmp_path / "recipe.yaml", tmp_path / "out"


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_2_resume_never_unpickles_code(trained, tmp_path, capsys):
    recipe, out = _fresh_copy(trained, tmp_path)
    optim = next((out / "checkpoint-1").rglob("*optim_states.pt"))
    marker = tmp_path / "pwned"
    torch.save({"optimizer_state_dict": _Payload(str(marker))}, optim)
    before = snapshot(out)
    fails(["train", str(recipe), "train.max_steps=2"], capsys, "refusing to load", optim.name, "allow-list")
    assert not marker.exists(), "the planted payload ran"
    assert snapshot(out) == {k: v for k, v in before.items()} | {k: v for k, v in snapshot(out).items() if "metrics" in k}
    assert not (out / "checkpoint-2").exists() and not leftovers(out)


def test_2_and_5_a_clean_resume_passes_the_allow_list_and_a_changed_base_is_refused(trained, tmp_path, capsys):
    root, _ = trained
    recipe, out = _fresh_copy(trained, tmp_path)
    assert _train(recipe, "train.max_steps=2") == 0  # DeepSpeed's own state loads under weights_only
    assert (out / "checkpoint-2").is_dir()
    capsys.readouterr()
    # same path, other weights: the base fingerprint in the checkpoint no longer matches
    model = root / "llama"
    shutil.copytree(model, tmp_path / "original")
    try:
        tiny.base_model(seed=1).save_pretrained(model)
        before = snapshot(out, model)
        fails(["train", str(recipe), "train.max_steps=3"], capsys, "other base weights", "values of")
        assert snapshot(out, model) == before and not (out / "checkpoint-3").exists() and not leftovers(out)
    finally:
        shutil.rmtree(model)
        shutil.copytree(tmp_path / "original", model)


# ---------------------------------------------------------------------- 3. deltas bind by absolute path + fingerprint
def test_3_delta_binds_to_its_base_by_path_and_fingerprint(base, tmp_path, capsys, monkeypatch):
    from retrofit import surgery

    work = tmp_path / "work"
    shutil.copytree(base, work / "llama")
    monkeypatch.chdir(work)
    assert main(convert_argv("llama", "delta", "--delta")) == 0
    manifest = json.loads((work / "delta" / "retrofit_delta.json").read_text())
    assert manifest["retrofit"]["base_model"] == str((work / "llama").resolve())
    assert manifest["base_fingerprint"]["tensors"] > 0
    # elsewhere, with a different ./llama in the cwd: still the recorded base
    elsewhere = tmp_path / "elsewhere"
    tiny.save_base(elsewhere / "llama", seed=1)
    monkeypatch.chdir(elsewhere)
    model = surgery.load(work / "delta")
    ref, _ = surgery.load_any(work / "llama")
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(dict(model.named_parameters())[name], dict(ref.named_parameters())[name])
    # explicitly attached to another base, or the base replaced at its path: refused
    with pytest.raises(CheckpointError, match="not the model this delta was made from"):
        surgery.load_delta(work / "delta", base=elsewhere / "llama")
    before = snapshot(work / "delta")
    shutil.rmtree(work / "llama")
    shutil.copytree(elsewhere / "llama", work / "llama")
    fails(["generate", str(work / "delta"), "--prompt", "a", "--max-new-tokens", "1"], capsys,
          "not the model this delta was made from")
    assert snapshot(work / "delta") == before


# ---------------------------------------------------------------------- 4. silent garbage training
def test_4_too_few_tokens_long_positions_and_bad_text_fail_before_step_1(base, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "empty.txt").write_text("")
    recipe = recipe_file(tmp_path, base, data, eval={"sequences": 0})
    fails(["train", str(recipe)], capsys, "holds 0 tokens", "one step needs 128")
    (data / "empty.txt").unlink()
    (data / "short.txt").write_text("Call me Ishmael. " * 40)  # ~300 tokens: a tenth of one step at 1000
    fails(["train", str(recipe), "data.seq_len=1000"], capsys, "one step needs 4000", "lower data.seq_len")
    fails(["train", str(recipe), "data.seq_len=2048"], capsys, "max_position_embeddings=1024",
          "data.allow_long_positions=true")
    (data / "latin1.txt").write_bytes("caf\u00e9 au lait ".encode("utf-8") * 3 + "na\u00efve".encode("latin-1"))
    fails(["train", str(recipe)], capsys, "latin1.txt: not valid UTF-8 at byte 44", "data.text_errors=replace")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)

    from retrofit.train.data import data_files
    from retrofit.train.data_checks import check_decodable, check_positions
    from retrofit.train.recipe import load_recipe

    r = load_recipe(recipe, ["data.text_errors=replace", "data.seq_len=2048", "data.allow_long_positions=true"])
    check_decodable(r, data_files(r))  # the explicit options let both through
    check_positions(r, tiny.base_model().config)


# ---------------------------------------------------------------------- 6. locks
def test_6_second_writer_of_an_output_is_refused_and_stale_locks_are_taken_over(base, books, tmp_path, capsys):
    from retrofit.fs.locks import lock_path
    from retrofit.fs.tempdirs import host_name
    from retrofit.surgery.checkpoint import atomic_directory

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom retrofit.fs.locks import output_lock\n"
         "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)", str(out)],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        fails(convert_argv(base, out), capsys, "being written by pid", str(holder.pid))
        recipe = recipe_file(tmp_path, base, books)
        fails(["train", str(recipe)], capsys, "being written by pid")
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    # a killed run's lock file (its pid gone) is free: the kernel released its lock
    lock_path(out).write_text(json.dumps({"pid": holder.pid, "host": host_name(), "time": 0}))
    assert main(convert_argv(base, out)) == 0
    assert not leftovers(tmp_path)
    # a target that appears while a writer works is not replaced without overwrite
    other = tmp_path / "race"
    with pytest.raises(CheckpointError, match="already exists"):
        with atomic_directory(other) as tmp:
            (tmp / "config.json").write_text("{}")
            shutil.copytree(out, other)
    assert (other / "model.safetensors").is_file() and not leftovers(tmp_path)


# ---------------------------------------------------------------------- 7. one error line, nothing partial
def test_7_broken_model_files_give_one_error_line(base, tmp_path, capsys):
    cases = {
        "truncated": lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:5000]),
        "garbage": lambda m: (m / "model.safetensors").write_bytes(b"\x00" * 100),
        "config": lambda m: (m / "config.json").write_text("{ not json"),
        "shape": lambda m: (m / "config.json").write_text(
            json.dumps({**json.loads((m / "config.json").read_text()), "hidden_size": 96})),
    }
    for name, damage in cases.items():
        model = tmp_path / name
        shutil.copytree(base, model)
        damage(model)
        before = snapshot(model)
        fails(convert_argv(model, tmp_path / f"out-{name}"), capsys, str(model))
        assert snapshot(model) == before and not (tmp_path / f"out-{name}").exists()
    # a converted checkpoint whose weights are cut short
    conv = tmp_path / "conv"
    assert main(convert_argv(base, conv)) == 0
    (conv / "model.safetensors").write_bytes((conv / "model.safetensors").read_bytes()[:20000])
    fails(["generate", str(conv), "--prompt", "a", "--max-new-tokens", "1"], capsys, "truncated or corrupt")
    assert not leftovers(tmp_path)


def test_7_unwritable_outputs_give_one_error_line(base, books, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fails(convert_argv(base, blocker / "out"), capsys, "lies below the file")
    fails(convert_argv(base, blocker), capsys, "is an existing file")

    import transformers

    real = transformers.PreTrainedModel.save_pretrained

    def disk_full(self, folder, *args, **kwargs):  # writes part of the checkpoint, then the disk is full
        real(self, folder, *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(folder) / "model.safetensors"))

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", disk_full)
    fails(convert_argv(base, tmp_path / "full"), capsys, "No space left on device", "nothing was written")
    assert not (tmp_path / "full").exists() and not leftovers(tmp_path)

    from safetensors import SafetensorError

    def safetensors_disk_full(self, folder, *args, **kwargs):  # safetensors' own error, not an OSError
        real(self, folder, *args, **kwargs)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", safetensors_disk_full)
    fails(convert_argv(base, tmp_path / "full"), capsys, "cannot write", "writing a safetensors file failed",
          "No space left on device", "nothing was written")
    assert not (tmp_path / "full").exists() and not leftovers(tmp_path)
    monkeypatch.undo()

    import retrofit.train.loop as loop

    def data_state_disk_full(state, folder, rank):
        (Path(folder) / f"data_state_rank{rank}.npz").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(loop, "_save_data_state", data_state_disk_full)
    recipe = recipe_file(tmp_path, base, books, train={"max_steps": 1}, checkpoint={"save_every": 1},
                         eval={"sequences": 0})
    fails(["train", str(recipe)], capsys, "cannot write checkpoint checkpoint-1", "No space left on device")
    assert not (tmp_path / "out" / "checkpoint-1").exists() and not leftovers(tmp_path / "out")

    def zip_writer_disk_full(state, folder, rank):  # torch.save's writer on a full disk: a RuntimeError
        (Path(folder) / f"data_state_rank{rank}.npz").write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 20590272 vs 20590152")

    monkeypatch.setattr(loop, "_save_data_state", zip_writer_disk_full)
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    fails(["train", str(recipe)], capsys, "cannot write checkpoint checkpoint-1", "a write failed", "MiB free")
    assert not (tmp_path / "out" / "checkpoint-1").exists() and not leftovers(tmp_path / "out")


def test_7_bad_numbers_bad_text_bad_device_bad_out(base, books, tmp_path, capsys):
    recipe = recipe_file(tmp_path, base, books)
    fails(["train", str(recipe), "train.lr=-1e-3"], capsys, "train.lr must be a finite number > 0")
    fails(["train", str(recipe), "train.lr=.nan"], capsys, "train.lr must be a finite number > 0")
    # eval reads local JSONL with the same strict policy as training
    conv = tmp_path / "conv"
    assert main(convert_argv(base, conv)) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9' + b' and more words' * 20 + b'"}\n')  # one window of 8 to score
    eval_argv = ["eval", "ppl", str(conv), "--lengths", "8", "--datasets", str(bad), "--max-windows", "1",
                 "--quiet", "--out", str(tmp_path / "ev")]
    fails(eval_argv, capsys, "bad.jsonl: not valid UTF-8 at byte 30", "--text-errors replace")
    assert main([*eval_argv, "--text-errors", "replace"]) == 0
    capsys.readouterr()
    (tmp_path / "report").write_text("not a folder")
    fails(["eval", "ppl", str(conv), "--out", str(tmp_path / "report")], capsys, "is an existing file")
    if not torch.cuda.is_available():
        fails(["generate", str(conv), "--prompt", "a", "--device", "cuda"], capsys, "CUDA is not available")
        fails(["eval", "ppl", str(conv), "--device", "cuda"], capsys, "CUDA is not available")
    assert not leftovers(tmp_path)


# ---------------------------------------------------------------------- 8. resource blow-ups
def test_8_huge_layer_ranges_fail_at_once(base, tmp_path, capsys):
    import time

    t0 = time.perf_counter()
    line = fails(convert_argv(base, tmp_path / "o", "--layers", "0-30000000"), capsys, "beyond any model")
    assert len(line) < 400
    fails(convert_argv(base, tmp_path / "o", "--layers", "0-40"), capsys, "do not exist", "has 2 layers")
    conv = tmp_path / "conv"
    assert main(convert_argv(base, conv)) == 0
    cfg = json.loads((conv / "config.json").read_text())
    cfg["retrofit"]["layers"] = "0-100000000"
    (conv / "config.json").write_text(json.dumps(cfg))
    fails(["generate", str(conv), "--prompt", "a", "--max-new-tokens", "1"], capsys, "beyond any model")
    assert time.perf_counter() - t0 < 60  # a range expanded into a list before its check: 81 s and 3 GB for the first command alone


# ---------------------------------------------------------------------- 9. orphans
_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import transformers
    from retrofit.cli.main import main

    sig = getattr(signal, sys.argv[1])
    real = transformers.PreTrainedModel.save_pretrained

    def save_then_die(self, folder, *a, **k):  # the signal arrives mid-save
        real(self, folder, *a, **k)
        os.kill(os.getpid(), sig)

    transformers.PreTrainedModel.save_pretrained = save_then_die
    sys.exit(main(sys.argv[2:]))
""")


def test_9_sigterm_removes_temporaries_and_a_later_run_removes_a_killed_ones(base, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "out"
    term = subprocess.run([sys.executable, str(script), "SIGTERM", *convert_argv(base, out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert term.returncode == 143 and "terminated" in term.stderr, term.stderr[-2000:]
    assert not out.exists() and not leftovers(tmp_path)
    kill = subprocess.run([sys.executable, str(script), "SIGKILL", *convert_argv(base, out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert kill.returncode == -signal.SIGKILL
    assert [p for p in leftovers(tmp_path) if ".tmp-" in p] and not out.exists()  # SIGKILL cannot clean up
    assert main(convert_argv(base, out)) == 0  # the next writer removes the dead run's folder and lock
    assert out.is_dir() and not leftovers(tmp_path)


def test_9_alias_cache_scratch_of_a_dead_process_is_removed(tmp_path):
    from retrofit.fs import clean_stale_temps, make_temp_dir

    code = ("import sys; from pathlib import Path; from retrofit.fs import make_temp_dir; "
            "make_temp_dir(Path(sys.argv[1]), 'gemma3-270m', kind='gguf'); "
            "make_temp_dir(Path(sys.argv[1]), 'gemma3-270m')")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    mine = make_temp_dir(tmp_path, "gemma3-270m", kind="gguf")  # a live writer's scratch stays
    assert len(leftovers(tmp_path)) == 3
    removed = clean_stale_temps(tmp_path)
    assert len(removed) == 2 and leftovers(tmp_path) == [str(mine)]


# ---------------------------------------------------------------------- 10. validation gaps
def test_10_validation(base, books, tmp_path, capsys):
    fails(convert_argv(base, tmp_path / "o", "--method", "exp-linear"), capsys, "--window, --latents",
          "do(es) not apply to method 'exp-linear'")
    fails(["convert", str(base), "--out", str(tmp_path / "o"), "--method", "exp-linear", "--init-swa-share", "0.5"],
          capsys, "--init-swa-share")
    recipe = recipe_file(tmp_path, base, books)
    fails(["train", str(recipe), "train.grad_clip=-1"], capsys, "train.grad_clip must be a finite number >= 0")
    fails(["train", str(recipe), "train.lr=0"], capsys, "train.lr must be a finite number > 0")
    fails(["eval", "harness", str(base), "--num-fewshot", "-1"], capsys, "num_fewshot", ">= 0")
    fails(["eval", "harness", str(base), "--num-fewshot", "piqa=-2"], capsys, "task piqa must be >= 0")
    assert not (tmp_path / "o").exists() and not (tmp_path / "out").exists()


def test_10_corrupt_tokenizer_is_not_reported_as_missing(base, tmp_path):
    from retrofit.surgery import load_any

    model = tmp_path / "m"
    shutil.copytree(base, model)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 7}}')
    with pytest.raises(CheckpointError, match="tokenizer files .*tokenizer.json.* cannot be read"):
        load_any(model)


def test_10_nan_advice_fits_the_precision():
    from retrofit.errors import TrainingError
    from retrofit.train.loop import _Run

    run = object.__new__(_Run)
    run.step, run.accum, run.last_saved = 4, 1, None
    for precision, advised in (("fp32", False), ("bf16", True)):
        run.precision = precision
        with pytest.raises(TrainingError) as exc:
            run._stop_non_finite("the training loss", float("nan"))
        assert ("train.precision=fp32" in str(exc.value)) is advised


def test_10_eval_and_train_share_the_text_policy(tmp_path):
    from retrofit.data.text import text_errors
    from retrofit.eval.corpora import CorpusSpec, iter_documents

    (tmp_path / "a.txt").write_bytes(b"good text \xff\xfe more")
    spec = CorpusSpec(name="local", path=str(tmp_path / "a.txt"))
    with pytest.raises(DataError, match=r"a.txt: not valid UTF-8 at byte 10"):
        list(iter_documents(spec))
    with text_errors("replace"):
        assert "\ufffd" in next(iter(iter_documents(spec))).text


def test_10_an_edited_retrofit_section_is_refused(base, tmp_path, capsys):
    from retrofit.surgery import load

    conv = tmp_path / "conv"
    assert main(convert_argv(base, conv)) == 0
    cfg = json.loads((conv / "config.json").read_text())
    cfg["retrofit"]["window"] = 64  # same weights, other behaviour
    (conv / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="section was edited"):
        load(conv)
    fails(["generate", str(conv), "--prompt", "a", "--max-new-tokens", "1"], capsys, "section was edited")
