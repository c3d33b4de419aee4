"""`retrofit bench`: speed and memory benchmarks. Results go to JSON + PNG + a printed table."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("bench", help=help_text, description=help_text)
    suites = p.add_subparsers(dest="suite", metavar="SUITE")

    a = suites.add_parser("attention", help="attention ops vs PyTorch SDPA causal across sequence lengths")
    a.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    a.add_argument("--batch", type=int, default=1)
    a.add_argument("--heads", type=int, default=8)
    a.add_argument("--head-dim", type=int, default=256)
    a.add_argument("--latents", type=int, default=16, help="latent states per head (L_h)")
    a.add_argument("--window", type=int, default=128)
    a.add_argument("--chunk-size", type=int, default=None, help="chunk size for the chunked ops (default: op default)")
    a.add_argument("--ops", nargs="+", default=None, help="subset of ops to time (default: all)")
    a.add_argument("--sdpa-max-length", type=int, default=32768, help="skip SDPA above this length")
    a.add_argument("--repeats", type=int, default=3)
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a.add_argument("--device", default="cpu")
    a.add_argument("--out", default="runs/bench/attention", help="folder for results.json and PNG")
    a.set_defaults(handler=_run_attention)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def _run_attention(args: argparse.Namespace) -> int:
    from retrofit.bench.attention import run_attention_benchmark

    run_attention_benchmark(args)
    return 0
