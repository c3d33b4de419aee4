"""A hostile re-test: each case reproduced on a tiny random model.

Every refusal is one ``error:`` line (exit 1, no traceback); no input file changes; nothing
partial (temporary or swap folders, locks, half checkpoints) remains.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from retrofit.cli.main import main
from retrofit.errors import CheckpointError
from tests.reliability.test_faults import REPO, convert_argv, fails, leftovers, snapshot
from tests.train import tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _window(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["retrofit"]["window"]


# ---------------------------------------------------------------------- a kill inside the --overwrite swap
_KILL_IN_SWAP = textwrap.dedent("""
    import os, signal, sys
    from retrofit.cli.main import main

    target, real = os.path.abspath(sys.argv[1]), os.rename

    def rename(src, dst, *a, **k):  # the target has been moved away and the new folder not yet in: die
        if os.path.abspath(dst) == target and not os.path.exists(target):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *a, **k)

    os.rename = rename
    sys.exit(main(sys.argv[2:]))
""")


def test_a_kill_between_the_swap_renames_loses_nothing_and_the_next_run_recovers(base, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(convert_argv(base, out, "--window", "8")) == 0
    script = tmp_path / "kill.py"
    script.write_text(_KILL_IN_SWAP)
    killed = subprocess.run([sys.executable, str(script), str(out), *convert_argv(base, out, "--window", "4", "--overwrite")],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()  # the kill landed between the renames
    capsys.readouterr()
    # the next writer (without --overwrite) completes the swap first, then refuses to replace it
    fails(convert_argv(base, out, "--window", "2"), capsys, "already exists")
    assert _window(out) == 4 and not leftovers(tmp_path)
    assert main(convert_argv(base, out, "--window", "2", "--overwrite")) == 0
    assert _window(out) == 2 and not leftovers(tmp_path)


def test_an_interrupt_between_the_swap_renames_keeps_the_previous_folder(base, tmp_path, monkeypatch):
    from retrofit.fs import atomic_directory

    out = tmp_path / "out"
    with atomic_directory(out) as tmp:
        (tmp / "weights.bin").write_text("old")
    real, hits = os.rename, []

    def rename(src, dst, *a, **k):  # Ctrl-C once, between the renames
        if os.path.abspath(dst) == str(out) and not out.exists() and not hits:
            hits.append(dst)
            raise KeyboardInterrupt
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(out, overwrite=True) as tmp:
            (tmp / "weights.bin").write_text("new")
    assert hits and (out / "weights.bin").read_text() == "old" and not leftovers(tmp_path)


def test_a_swap_folder_that_holds_the_only_copy_is_never_deleted(tmp_path):
    from retrofit.fs import atomic_directory, clean_stale_temps
    from retrofit.fs.tempdirs import host_name

    out = tmp_path / "out"
    swap = tmp_path / f".out.old-999999-{host_name()}-0123abcd"  # a dead writer's swap: only old/ made it in
    (swap / "old").mkdir(parents=True)
    (swap / "old" / "weights.bin").write_text("the only copy")
    assert clean_stale_temps(tmp_path) == [] and swap.is_dir()
    with pytest.raises(CheckpointError, match="already exists"):
        with atomic_directory(out) as tmp:  # the lock settles the swap: old/ is back, so this write is refused
            (tmp / "weights.bin").write_text("new")
    assert (out / "weights.bin").read_text() == "the only copy" and not leftovers(tmp_path)


# ---------------------------------------------------------------------- --overwrite and files that are not ours
def test_overwrite_never_deletes_a_file_retrofit_did_not_write(base, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(convert_argv(base, out, "--window", "8")) == 0
    for name in ("notes.txt", "results.json", "extra.bin", "my.model"):  # all names a checkpoint could hold
        (out / name).write_text("precious")
        before = snapshot(out)
        fails(convert_argv(base, out, "--window", "4", "--overwrite"), capsys, "not a checkpoint folder", name,
              "retrofit did not write")
        assert snapshot(out) == before and not leftovers(tmp_path)
        (out / name).unlink()
    # a transformers folder retrofit did not write: config.json + weights are not proof enough
    plain = tmp_path / "plain"
    shutil.copytree(base, plain)
    before = snapshot(plain)
    fails(convert_argv(base, plain, "--overwrite"), capsys, "not a checkpoint folder", "no readable .retrofit-files.json")
    assert snapshot(plain) == before
    # what retrofit wrote, as it wrote it, is replaced
    assert main(convert_argv(base, out, "--window", "4", "--overwrite")) == 0
    assert _window(out) == 4 and not leftovers(tmp_path)


# ---------------------------------------------------------------------- resume: the same model, tokenizer, state
@pytest.fixture(scope="module")
def trained(tmp_path_factory, base, books):
    """A 1-step run with its checkpoint-1, on a private copy of the base."""
    from tests.reliability.test_faults import recipe_file

    root = tmp_path_factory.mktemp("trained")
    shutil.copytree(base, root / "llama")
    recipe = recipe_file(root, root / "llama", books, train={"max_steps": 1},
                         checkpoint={"save_every": 1, "export": False}, eval={"sequences": 0})
    assert main(["train", str(recipe)]) == 0
    return root, recipe


@pytest.fixture
def resumable(trained, tmp_path):
    """A private copy of the run's output: (recipe, output folder, base folder). The base stays at the
    path the recipe names (a moved base is another recipe); a test may alter it: it is restored after."""
    root, recipe = trained
    shutil.copytree(root / "out", tmp_path / "out")
    (tmp_path / "recipe.yaml").write_text(recipe.read_text().replace(str(root / "out"), str(tmp_path / "out")))
    shutil.copytree(root / "llama", tmp_path / "base-backup")
    try:
        yield tmp_path / "recipe.yaml", tmp_path / "out", root / "llama"
    finally:
        shutil.rmtree(root / "llama")
        shutil.copytree(tmp_path / "base-backup", root / "llama")


def _refused_resume(recipe: Path, out: Path, capsys, *needles: str) -> None:
    before = snapshot(out)
    fails(["train", str(recipe), "train.max_steps=2"], capsys, *needles)
    after = {k: v for k, v in snapshot(out).items() if "metrics" not in k and "recipe.yaml" not in k}
    assert after == {k: v for k, v in before.items() if k in after} and set(after) <= set(before)
    assert not (out / "checkpoint-2").exists() and not leftovers(out)


def _other_tokenizer():
    """A BPE of the same vocabulary size trained on another book: the same text, other ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=tiny.VOCAB, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([tiny.book_text("pride-and-prejudice.txt", chars=100_000)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_resume_refuses_a_tokenizer_swapped_at_the_base_path(resumable, tmp_path, capsys):
    recipe, out, model = resumable
    other = _other_tokenizer()
    assert len(other) == len(tiny.tokenizer()) and other("Call me Ishmael").input_ids != tiny.tokenizer()("Call me Ishmael").input_ids
    other.save_pretrained(model)
    _refused_resume(recipe, out, capsys, "another tokenizer", "restore the original tokenizer files")


def test_resume_refuses_one_changed_embedding_row(resumable, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    recipe, out, model = resumable
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"][5] += 0.5  # one row of 320; the 8 evenly spaced samples miss it
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    _refused_resume(recipe, out, capsys, "other base weights", "model.embed_tokens.weight", "row changed")


@pytest.mark.parametrize("key", ["section_digest", "tokenizer_digest", "base_fingerprint"])
def test_resume_refuses_a_state_without_its_digests(resumable, tmp_path, capsys, key):
    recipe, out, _ = resumable
    state_file = out / "checkpoint-1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state[key]
    state_file.write_text(json.dumps(state))
    _refused_resume(recipe, out, capsys, f"has no", f"({key})", "start fresh")


def test_resume_refuses_a_pre_release_base_fingerprint(resumable, tmp_path, capsys):
    recipe, out, _ = resumable
    state_file = out / "checkpoint-1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["base_fingerprint"]["format"] = "retrofit-fingerprint/1"  # what pre-release versions wrote
    state_file.write_text(json.dumps(state))
    _refused_resume(recipe, out, capsys, "format 'retrofit-fingerprint/1'", "does not read", "start fresh")


def test_resume_reports_a_tampered_random_state_file(resumable, tmp_path, capsys):
    import torch

    from tests.reliability.test_faults import _Payload

    recipe, out, _ = resumable
    marker = tmp_path / "pwned"
    torch.save({"python": _Payload(str(marker))}, out / "checkpoint-1" / "random_states_0.pkl")
    _refused_resume(recipe, out, capsys, "random_states_0.pkl", "refusing to load")
    assert not marker.exists()
    (out / "checkpoint-1" / "random_states_0.pkl").write_bytes(b"")  # truncated to nothing
    _refused_resume(recipe, out, capsys, "random_states_0.pkl", "cannot be read")


@pytest.mark.parametrize("name,damage", [
    ("data_state_rank0.json", b"{ not json"),
    ("data_state_rank0.json", b'{"rng": 3}'),
    ("data_state_rank0.npz", b"PK\x03\x04 garbage"),
])
def test_resume_reports_a_damaged_data_state(resumable, tmp_path, capsys, name, damage):
    recipe, out, _ = resumable
    (out / "checkpoint-1" / name).write_bytes(damage)
    _refused_resume(recipe, out, capsys, "data position", "is damaged", "resume from an earlier checkpoint")


# ---------------------------------------------------------------------- the exported LoRA adapter's card
def test_the_lora_adapter_card_names_the_converted_model_it_was_trained_on(tmp_path):
    import torch
    import yaml
    from peft import PeftModel

    import retrofit
    from retrofit.surgery import new_parameter_names
    from retrofit.train.export import export_lora
    from retrofit.train.trainable import apply_trainable

    model = retrofit.load(tiny.save_converted(tmp_path / "conv"))
    peft_model = apply_trainable(model, "lora", new_parameter_names(model),
                                 lora={"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "latent_q" in name:
                p.add_(torch.randn_like(p) * 0.1)  # a trained adapter: its new weights differ from the base's
    merged = export_lora(peft_model, tmp_path / "run", tokenizer=tiny.tokenizer())
    card = (tmp_path / "run" / "adapter" / "README.md").read_text()
    base_model = yaml.safe_load(card.split("---")[1])["base_model"]
    assert base_model == str((tmp_path / "run" / "adapter-base").resolve())
    followed = PeftModel.from_pretrained(retrofit.load(base_model), tmp_path / "run" / "adapter")  # what the card says
    ids = torch.randint(3, tiny.VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(followed(input_ids=ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------- stages after a re-run
def _staged_recipe(tmp_path: Path, base: Path, books: Path, **train) -> Path:
    import yaml

    d = tiny.recipe_dict(base, books, tmp_path / "staged", train={"max_steps": 1, "gradient_checkpointing": False,
                                                                   **train},
                         checkpoint={"save_every": 1, "keep_last": 1}, eval={"sequences": 0})
    d["stages"] = [{"name": "one"}, {"name": "two"}, {"name": "three"}]
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_a_rerun_stage_never_leaves_later_stages_on_its_former_output(base, books, tmp_path, capsys):
    from retrofit.train import train
    from retrofit.train.recipe import load_recipe

    recipe = _staged_recipe(tmp_path, base, books)
    out = tmp_path / "staged"
    first = train(load_recipe(recipe, []))
    assert first.final_dir == out / "stage-3-three" / "final"
    capsys.readouterr()
    # settings that change no result (how many checkpoints stay) continue the folder; all is finished
    again = train(load_recipe(recipe, ["checkpoint.keep_last=3"]))
    assert again.history == [] and again.final_dir == out / "stage-3-three" / "final"
    # other settings are refused, naming what changed
    fails(["train", str(recipe), "train.lr=1e-2"], capsys, "different multi-stage recipe", "changed: train.lr")
    # stage one's DONE deleted: it would run again, and stages two and three hold work built on its old output
    (out / "stage-1-one" / "DONE").unlink()
    before = snapshot(out)
    fails(["train", str(recipe)], capsys, "stage-1-one is not finished", "stage-2-two",
          "stage-3-three", "delete")
    assert snapshot(out) == before and not leftovers(out)


def test_a_stage_trained_on_a_former_output_is_refused(base, books, tmp_path, capsys):
    from retrofit.train import train
    from retrofit.train.recipe import load_recipe

    recipe = _staged_recipe(tmp_path, base, books)
    out = tmp_path / "staged"
    train(load_recipe(recipe, []))
    done = out / "stage-1-one" / "DONE"
    done.write_text(json.dumps({**json.loads(done.read_text()), "id": "0123456789abcdef"}))  # stage one ran again
    capsys.readouterr()
    fails(["train", str(recipe)], capsys, "stage-2-two was trained on an earlier output of stage-1-one")


# ---------------------------------------------------------------------- -q is quiet
def test_quiet_convert_and_train_print_only_warnings_and_errors(base, books, tmp_path, capsys):
    from tests.reliability.test_faults import recipe_file

    assert main([*convert_argv(base, tmp_path / "conv"), "-q"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "INFO" not in err and "converted" not in err, (out, err)
    recipe = recipe_file(tmp_path, base, books, train={"max_steps": 1}, checkpoint={"save_every": 1, "export": False},
                         eval={"sequences": 0})
    assert main(["train", str(recipe), "-q"]) == 0
    out, err = capsys.readouterr()
    assert "[retrofit]" not in out and "INFO" not in err, (out, err)
    assert main(convert_argv(base, tmp_path / "loud")) == 0  # without -q the info lines are there
    assert "converted" in capsys.readouterr().out


# ---------------------------------------------------------------------- one error line, not a traceback
@pytest.mark.parametrize("device", ["mps", "xpu", "meta"])
def test_unusable_devices_are_one_error_line(base, tmp_path, capsys, device):
    import torch

    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    if device == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        pytest.skip("this machine has an XPU")
    fails(["generate", str(base), "--prompt", "a", "--max-new-tokens", "1", "--device", device], capsys,
          f"--device {device}", "use")
    fails(["bench", "decode", "--quick", "--device", device, "--out", str(tmp_path / "b")], capsys, f"--device {device}")
    assert not (tmp_path / "b").exists()


def test_files_that_are_not_gguf_models_are_one_error_line(tmp_path, capsys):
    (tmp_path / "notes.gguf").write_text("hello")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 21)
    before = snapshot(tmp_path)
    fails(["generate", str(tmp_path / "notes.gguf"), "--prompt", "a"], capsys, "is not a GGUF file")
    fails(["generate", str(tmp_path / "garbage.gguf"), "--prompt", "a"], capsys, "is not a readable GGUF model")
    assert snapshot(tmp_path) == before and not leftovers(tmp_path)


def test_a_missing_gguf_file_is_not_a_hub_id_and_an_unreachable_hub_fails_at_once(tmp_path, capsys, monkeypatch):
    import time

    monkeypatch.chdir(tmp_path)
    fails(["generate", "x.gguf", "--prompt", "a"], capsys, "x.gguf does not exist")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: as good as no network
    t0 = time.perf_counter()
    fails(["generate", "someone/no-such-model", "--prompt", "a"], capsys, "cannot be reached", "HF_HUB_OFFLINE=1")
    assert time.perf_counter() - t0 < 15  # not a minute of retries


def test_an_empty_prompt_without_bos_is_one_error_line(tmp_path, capsys):
    base = tiny.save_base(tmp_path / "nobos")
    spec = json.loads((base / "tokenizer.json").read_text())
    spec["post_processor"] = None  # no BOS added: an empty prompt is zero tokens
    (base / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("bos_token", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    fails(["generate", str(base), "--prompt", "", "--max-new-tokens", "1"], capsys, "--prompt is empty")
    assert main(["generate", str(tiny.save_base(tmp_path / "bos")), "--prompt", "", "--max-new-tokens", "1"]) == 0


def test_a_yaml_tag_in_an_option_is_one_error_line(base, tmp_path, capsys):
    fails(convert_argv(base, tmp_path / "o", "--option", "window=!!python/name:os.system"), capsys,
          "--option window", "is not a plain YAML value")
    fails(convert_argv(base, tmp_path / "o", "--option", "window=[1"), capsys, "is not a plain YAML value")
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path)


def test_a_jsonl_file_with_one_bad_line_fails_before_training(base, tmp_path, capsys):
    from tests.reliability.test_faults import recipe_file

    data = tmp_path / "data"
    good = [json.dumps({"text": tiny.book_text(chars=2_000)}) for _ in range(3)]
    data.mkdir()
    (data / "a.jsonl").write_text("\n".join([*good, '{"text": "cut short', *good]) + "\n")
    recipe = recipe_file(tmp_path, base, data, eval={"sequences": 0})
    fails(["train", str(recipe)], capsys, "a.jsonl: line 4 is not valid JSON", "fix or delete that line")
    (data / "a.jsonl").write_text("\n".join([*good, "[1, 2]"]) + "\n")
    fails(["train", str(recipe)], capsys, "a.jsonl: line 4 is a JSON list")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------- convert --help stays instant
def test_convert_help_imports_no_torch_and_its_flag_table_matches_the_method_configs():
    from retrofit.cli.convert import method_flag_table
    from retrofit.cli.method_flag_table import TABLE

    assert TABLE == method_flag_table(), "regenerate retrofit/cli/method_flag_table.py (see its docstring)"
    code = ("import sys\nfrom retrofit.cli.main import main\ntry:\n    main(['convert', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch imported:', 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--window" in run.stdout and "--segment" in run.stdout and "torch imported: False" in run.stdout
