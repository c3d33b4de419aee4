"""`retrofit generate`: streams text from a converted checkpoint, reports the constant cache size."""
from __future__ import annotations

import torch

from retrofit.cli.main import main
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
