"""`retrofit generate`: streams text from a converted checkpoint, reports the constant cache size."""
from __future__ import annotations

import pytest
import torch

from retrofit.cli.main import main
from retrofit.decoding import cpu_compiler_available
from retrofit.surgery import ConversionSpec, convert, save
from tests.surgery.tiny import tiny_model, tiny_tokenizer


def test_generate_streams_text(tmp_path, capsys):
    model = convert(tiny_model("llama"), ConversionSpec(window=8, latents=8), base_model="tiny")
    save(model, tmp_path / "mac", tokenizer=tiny_tokenizer())
    capsys.readouterr()  # what saving printed (DeepSpeed's first-import notice) is not generate's output
    rc = main(["generate", str(tmp_path / "mac"), "--prompt", "It is a truth universally", "--max-new-tokens", "20"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.startswith("It is a truth universally") and len(out.out) > len("It is a truth universally")
    assert "20 tokens" in out.err and "cache" in out.err and "MiB" in out.err
    torch.manual_seed(0)
    rc = main(["generate", str(tmp_path / "mac"), "--prompt", "My dear", "--max-new-tokens", "8",
               "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"])
    assert rc == 0 and capsys.readouterr().out.startswith("My dear")


def test_generate_errors(tmp_path, capsys):
    model = convert(tiny_model("llama"), ConversionSpec(window=8, latents=8), base_model="tiny")
    save(model, tmp_path / "notok")
    assert main(["generate", str(tmp_path / "notok"), "--prompt", "hi"]) == 1
    assert "has no tokenizer" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "notok"), "--prompt", "hi", "--top-p", "0"]) == 1


@pytest.mark.skipif(not cpu_compiler_available(), reason="torch.compile on a CPU needs a C++ compiler")
def test_generate_compiled_writes_what_eager_greedy_writes(tmp_path, capsys):
    model = convert(tiny_model("llama"), ConversionSpec(window=8, latents=8, sinks=2), base_model="tiny")
    save(model, tmp_path / "mac", tokenizer=tiny_tokenizer())
    capsys.readouterr()
    args = ["generate", str(tmp_path / "mac"), "--prompt", "It is a truth universally", "--max-new-tokens", "20"]
    assert main(args) == 0
    eager = capsys.readouterr().out
    assert main([*args, "--compile"]) == 0
    out = capsys.readouterr()
    assert out.out == eager and "compiled step" in out.err and "MiB" in out.err
    assert main([*args, "--compile", "--temperature", "0.8", "--top-p", "0.9"]) == 0
    assert capsys.readouterr().out.startswith("It is a truth universally")


def test_generate_compile_refuses_what_it_cannot_run(tmp_path, capsys):
    model = convert(tiny_model("gemma2"), ConversionSpec(window=8, latents=8, layers="all"), base_model="tiny")
    save(model, tmp_path / "g2", tokenizer=tiny_tokenizer())
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "g2"), "--prompt", "hi", "--compile"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.replace("\r", "\n").splitlines() if "error:" in line]
    assert len(errors) == 1 and "error: --compile:" in errors[0] and "without --compile" in errors[0]
    assert "Traceback" not in err
