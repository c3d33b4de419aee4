"""`retrofit bench SUITE --lengths` reads lengths as `retrofit eval` does (4096, 4K, 32K, 1M), through the
one parser both share; a bad length is one `error:` line before any work."""
from __future__ import annotations

import argparse

import pytest

from retrofit.cli.main import build_parser, main
from retrofit.eval.evaluators import length_arg

SUITES = ("attention", "decode", "model")


def test_length_arg_takes_k_and_m_suffixes():
    assert [length_arg(t) for t in ("4096", "4K", "32k", "1M", "2m")] == [4096, 4096, 32768, 1 << 20, 2 << 20]
    with pytest.raises(argparse.ArgumentTypeError, match="1M"):
        length_arg("4G")


@pytest.mark.parametrize("suite", SUITES)
def test_bench_lengths_take_suffixes(suite):
    args = build_parser().parse_args(["bench", suite, "--lengths", "4K", "32K", "1M", "512"])
    assert args.lengths == [4096, 32768, 1 << 20, 512]


@pytest.mark.parametrize("suite", SUITES)
def test_bench_lengths_use_evals_parser(suite):
    parser = build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]
    leaf = bench._subparsers._group_actions[0].choices[suite]
    assert leaf._option_string_actions["--lengths"].type is length_arg


def test_attention_sdpa_max_length_takes_suffixes():
    assert build_parser().parse_args(["bench", "attention", "--sdpa-max-length", "16K"]).sdpa_max_length == 16384


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("bad", ["4x", "1.5", "0"])
def test_bad_length_is_one_error_line(suite, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", suite, "--lengths", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"retrofit bench {suite}: error: argument --lengths")
    assert "Traceback" not in err
