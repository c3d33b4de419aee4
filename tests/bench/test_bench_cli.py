"""`retrofit bench attention / decode / model` end to end with tiny settings: the files appear and
hold what the table shows. No timing assertions (the machine is shared)."""
from __future__ import annotations

import json

import pytest
import torch

from retrofit.bench.common import MALLOC_MODES, set_malloc_mode
from retrofit.cli.main import main
from retrofit.decoding import cpu_compiler_available

TINY_ATTENTION = ["--heads", "2", "--head-dim", "16", "--latents", "8", "--window", "8", "--repeats", "1",
                  "--max-seconds", "1", "--threads", "1", "--quiet"]


@pytest.fixture(autouse=True)
def _restore_threads_and_malloc():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
    set_malloc_mode("system")  # in-process suites switch this test process to the cached mode


def test_malloc_modes():
    assert set(MALLOC_MODES) == {"cached", "system"}
    with pytest.raises(ValueError, match="choose from cached, system"):
        set_malloc_mode("jemalloc")
    assert set_malloc_mode("cached") and set_malloc_mode("system")  # glibc (Linux CI)


def _png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    return data


def test_attention_all_ops_in_process(tmp_path):
    out = tmp_path / "att"
    rc = main(["bench", "attention", "--lengths", "64", "128", "--no-isolate", "--out", str(out), *TINY_ATTENTION])
    assert rc == 0
    report = json.loads((out / "results.json").read_text())
    rows = report["rows"]
    assert {(r["op"], r["mode"], r["T"]) for r in rows} == {
        (op, mode, T) for op in ("latte", "macchiato", "swa", "exp_linear", "delta", "sdpa") for mode in ("fwd", "fwd+bwd")
        for T in (64, 128)
    }
    for r in rows:
        assert r["time_s"] > 0 and r["flops"] > 0 and r["efficiency"] > 0
        assert r["speedup_vs_sdpa"] is not None  # SDPA ran at every length
        assert r["backend"] in ("torch", "torch+torch", "torch sdpa")  # CPU: always torch
        assert (r["saved_bytes"] is None) == (r["mode"] == "fwd")
    sdpa = [r for r in rows if r["op"] == "sdpa"]
    assert all(abs(r["speedup_vs_sdpa"] - 1.0) < 1e-9 for r in sdpa)
    assert report["reference_matmul_flops_per_s"] > 0
    assert report["hardware"]["torch"] == torch.__version__ and report["hardware"]["cpu_count"] >= 1
    assert report["backends_installed"]["torch"] is True and report["complete"] is True
    _png(out / "attention.png")
    md = (out / "results.md").read_text()
    assert "x SDPA" in md and md.count("latte") >= 4
    assert report["config"]["malloc"] == "cached" and "malloc=cached" in md
    # --latents is L in total, as in convert and bench decode: 8 over --heads 2 is 4 per head
    assert (report["config"]["latents"], report["config"]["latents_per_head"]) == (8, 4) and "L=8 (L_h=4)" in md


def test_attention_keeps_measured_points_when_stopped(tmp_path, monkeypatch):
    """A run stopped part way (a time limit, Ctrl-C) leaves results.json with the points done so far."""
    import retrofit.bench.attention as attention

    measured = attention.measure_point

    def stop_at_second_length(payload):
        if payload["T"] == 128:
            raise KeyboardInterrupt
        return measured(payload)

    monkeypatch.setattr(attention, "measure_point", stop_at_second_length)
    out = tmp_path / "stopped"
    rc = main(["bench", "attention", "--lengths", "64", "128", "--ops", "latte", "sdpa", "--modes", "fwd",
               "--no-isolate", "--out", str(out), *TINY_ATTENTION])
    assert rc != 0  # the CLI reports the interruption
    report = json.loads((out / "results.json").read_text())
    assert report["complete"] is False
    assert {(r["op"], r["T"]) for r in report["rows"]} == {("latte", 64), ("sdpa", 64)}
    assert "latte" in (out / "results.md").read_text()


def test_attention_isolated_worker_measures_memory(tmp_path):
    out = tmp_path / "iso"
    rc = main(["bench", "attention", "--lengths", "512", "--ops", "latte", "--modes", "fwd+bwd",
               "--out", str(out), *TINY_ATTENTION])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["latte"] and all("error" not in r for r in rows)
    for r in rows:  # the worker ran with a resettable peak-RSS meter (Linux) and saw the backward's tensors
        assert r["memory_method"] in ("peak RSS (VmHWM)", "none")
        assert r["saved_bytes"] > 0


def test_latents_must_split_over_the_heads(tmp_path, capsys):
    rc = main(["bench", "attention", "--heads", "4", "--latents", "6", "--out", str(tmp_path), "--quiet"])
    assert rc == 1 and "--latents 6 is L in total and must split over the 4 query heads" in capsys.readouterr().err


def test_bench_rejects_a_window_the_method_lacks(tmp_path, capsys):
    rc = main(["bench", "decode", "--method", "exp-linear", "--window", "8", "--tiny-size", "tiny",
               "--lengths", "32", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "error: window" in err and "does not apply to method 'exp-linear'" in err


def test_attention_rejects_unknown_op(tmp_path, capsys):
    rc = main(["bench", "attention", "--ops", "flashy", "--out", str(tmp_path), "--quiet"])
    assert rc == 1 and "unknown op(s) flashy" in capsys.readouterr().err


def test_decode_and_model_compare_converted_with_base(tmp_path):
    common = ["--tiny-size", "tiny", "--window", "16", "--threads", "1", "--quiet"]
    rc = main(["bench", "decode", "--lengths", "32", "96", "--new-tokens", "3", "--prefill-chunk", "40",
               "--out", str(tmp_path / "dec"), *common])
    assert rc == 0
    dec = json.loads((tmp_path / "dec" / "results.json").read_text())
    by = {(r["model"], r["T"]): r for r in dec["rows"]}
    assert set(by) == {(m, T) for m in ("base", "converted") for T in (32, 96)}
    assert all(r["step_s"] > 0 and len(r["steps_s"]) == 3 for r in by.values())
    # the base's key/value cache grows with the context; the converted one stops at the window
    assert by[("base", 96)]["cache_bytes"] == 3 * by[("base", 32)]["cache_bytes"]
    assert by[("converted", 96)]["cache_bytes"] == by[("converted", 32)]["cache_bytes"] < by[("base", 96)]["cache_bytes"]
    assert dec["models"]["method"] == "macchiato"
    # --latents unset: LATENTS_PER_HEAD per query head, recorded as L in total
    from retrofit.bench.defaults import LATENTS_PER_HEAD

    heads = 4  # the tiny bench Llama
    assert dec["models"]["retrofit"]["latents"] == LATENTS_PER_HEAD * heads
    assert dec["models"]["retrofit"]["window"] == 16
    _png(tmp_path / "dec" / "decode.png")

    rc = main(["bench", "model", "--lengths", "64", "--repeats", "1", "--out", str(tmp_path / "mod"), *common])
    assert rc == 0
    mod = json.loads((tmp_path / "mod" / "results.json").read_text())
    kinds = {(r["model"], r["kind"]): r for r in mod["rows"]}
    assert set(kinds) == {(m, k) for m in ("base", "converted") for k in ("prefill", "train")}
    assert all(r["tokens_per_s"] > 0 for r in kinds.values())
    # by default the converted model trains only its new weights
    assert kinds[("converted", "train")]["trainable_parameters"] < kinds[("base", "train")]["trainable_parameters"]
    _png(tmp_path / "mod" / "model.png")


def test_decode_steps_of_the_two_models_are_interleaved():
    """Both caches are prefilled first, then the timed steps alternate, so load drift hits both."""
    from retrofit.bench.decode import decode_points
    from tests.surgery.tiny import tiny_model

    models = {"base": tiny_model("llama"), "converted": tiny_model("llama", seed=1)}
    calls = []
    for name, m in models.items():
        m.register_forward_pre_hook(lambda mod, args, kwargs, name=name: calls.append((name, kwargs["input_ids"].shape[1])),
                                    with_kwargs=True)
    rows = decode_points(models, 12, batch=1, new_tokens=3, prefill_chunk=8, device=torch.device("cpu"))
    assert calls == [("base", 8), ("base", 4), ("converted", 8), ("converted", 4)] + [("base", 1), ("converted", 1)] * 3
    assert all(len(r["steps_s"]) == 3 and r["T"] == 12 for r in rows.values())


def test_model_training_step_with_sliced_loss_and_checkpointing(tmp_path):
    """The long-sequence training step: the trainer's sliced LM head and activation checkpointing,
    recorded in the report; the step updates the trainable weights and leaves checkpointing off."""
    import argparse

    from retrofit.bench.model import _step
    from tests.surgery.tiny import tiny_model

    model = tiny_model("gemma2")  # final logit soft-capping goes through the sliced head too
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, int(model.config.vocab_size), (1, 24))
    args = argparse.Namespace(train_all=False, loss="sliced", checkpointing=True)
    def checkpointing() -> bool:  # is_gradient_checkpointing warns on transformers >= 5.24
        return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

    with _step(model, ids, "train", args) as (run, trainable):
        assert checkpointing() and model.training
        run()
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not checkpointing() and not model.training

    common = ["--tiny-size", "tiny", "--window", "16", "--threads", "1", "--quiet"]
    rc = main(["bench", "model", "--lengths", "48", "--repeats", "1", "--loss", "sliced", "--checkpointing",
               "--out", str(tmp_path / "mod"), *common])
    assert rc == 0
    mod = json.loads((tmp_path / "mod" / "results.json").read_text())
    assert mod["config"]["loss"] == "sliced" and mod["config"]["checkpointing"] is True
    assert all(r.get("tokens_per_s", 0) > 0 for r in mod["rows"]), mod["rows"]


def test_model_base_attention_is_recorded(tmp_path):
    """``--base-attention retrofit`` runs the base under the retrofit implementation and says so."""
    common = ["--tiny-size", "tiny", "--window", "16", "--threads", "1", "--quiet", "--repeats", "1", "--no-train"]
    for choice, want in (("loaded", "sdpa"), ("retrofit", "retrofit")):
        out = tmp_path / choice
        assert main(["bench", "model", "--lengths", "40", "--base-attention", choice, "--out", str(out), *common]) == 0
        report = json.loads((out / "results.json").read_text())
        assert report["config"]["base_attention"] == want
        assert f"(attention: {want})" in report["models"]["base"]
        assert all(r.get("tokens_per_s", 0) > 0 for r in report["rows"]), report["rows"]


def test_model_training_only_without_the_memory_pass(tmp_path, capsys):
    """``--no-prefill --no-memory``: training rows only, timed, no peaks; both off is one error line."""
    common = ["--tiny-size", "tiny", "--window", "16", "--threads", "1", "--quiet", "--repeats", "1"]
    out = tmp_path / "train-only"
    assert main(["bench", "model", "--lengths", "40", "--no-prefill", "--no-memory", "--out", str(out), *common]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["config"]["memory_pass"] is False
    assert {r["kind"] for r in report["rows"]} == {"train"} and len(report["rows"]) == 2
    assert all(r.get("tokens_per_s", 0) > 0 and "peak_bytes" not in r for r in report["rows"]), report["rows"]
    capsys.readouterr()
    assert main(["bench", "model", "--no-prefill", "--no-train", "--out", str(tmp_path / "none"), *common]) == 1
    assert "error: --no-prefill and --no-train leave nothing to measure" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def _mapped_ranges(path_suffix: str) -> list[tuple[int, int]]:
    out = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6 and parts[-1].endswith(path_suffix):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_pair_weights_live_in_process_memory_not_the_mapped_checkpoint(tmp_path):
    """A saved checkpoint loads as a map of its safetensors file; the bench copies the weights out
    so a dropped page-cache page is never re-read (and counted) inside a timed step."""
    import argparse

    from retrofit.bench.models import build_pair
    from retrofit.surgery import load_any
    from tests.surgery.tiny import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "ckpt")
    loaded, _ = load_any(str(tmp_path / "ckpt"), dtype=torch.float32)
    mapped = _mapped_ranges("model.safetensors")
    in_map = lambda m: [n for n, p in m.named_parameters() if any(lo <= p.data_ptr() < hi for lo, hi in mapped)]  # noqa: E731
    if not in_map(loaded):
        pytest.skip("this transformers copies weights at load (nothing to test)")
    args = argparse.Namespace(model=str(tmp_path / "ckpt"), converted=str(tmp_path / "ckpt"), dtype="float32",
                              device="cpu", tiny_size="tiny", seed=0, method="macchiato")
    base, converted, _ = build_pair(args, 64)
    mapped = _mapped_ranges("model.safetensors")
    assert in_map(base) == [] and in_map(converted) == []
    for model in (base, converted):
        if model.config.tie_word_embeddings:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.skipif(not cpu_compiler_available(), reason="torch.compile on a CPU needs a C++ compiler")
def test_decode_compiled_times_the_base_as_shipped_and_compiled(tmp_path):
    """--compile: the converted model through CompiledDecoder, the base twice (as it ships and with a
    StaticCache + torch.compile); compilation is an untimed first step, recorded apart."""
    rc = main(["bench", "decode", "--lengths", "32", "96", "--new-tokens", "3", "--prefill-chunk", "40", "--compile",
               "--tiny-size", "tiny", "--window", "16", "--threads", "1", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    dec = json.loads((tmp_path / "results.json").read_text())
    by = {(r["model"], r["T"]): r for r in dec["rows"]}
    assert set(by) == {(m, T) for m in ("base", "base_compiled", "converted") for T in (32, 96)}
    assert all(r["step_s"] > 0 and len(r["steps_s"]) == 3 for r in by.values())
    assert all("compile_s" in by[(m, T)] for m in ("base_compiled", "converted") for T in (32, 96))
    assert "compile_s" not in by[("base", 32)]
    # the compiled decoder's state is the window and the latent states, whatever the context
    assert by[("converted", 96)]["cache_bytes"] == by[("converted", 32)]["cache_bytes"] < by[("base", 96)]["cache_bytes"]
    assert dec["config"]["compile"] is True
    assert "speedup vs compiled base" in (tmp_path / "results.md").read_text()


def test_decode_compile_refuses_a_model_it_cannot_compile_before_any_work(tmp_path, capsys):
    rc = main(["bench", "decode", "--method", "exp-linear", "--tiny-size", "tiny", "--lengths", "32", "--compile",
               "--threads", "1", "--quiet", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "error: --compile: layer 0 (ExpLinearAttention) has no compiled decoding step" in err
    assert not (tmp_path / "results.json").exists()
