"""`retrofit bench`: speed and memory benchmarks. Results go to JSON + PNG + a printed table.

    retrofit bench attention [--quick]     attention ops vs SDPA causal, T = 1K..32K
    retrofit bench decode    [--quick]     per-token decoding latency vs context, converted vs base
    retrofit bench model     [--quick]     prefill and training-step tokens/s, converted vs base
"""
from __future__ import annotations

import argparse
from typing import Callable

from retrofit.eval.evaluators import count_arg, length_arg, positive_float_arg


def _common(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default=None,
                   help="attention kernels: auto | torch | fla | flash | flex, or a comma list "
                        "(default: $RETROFIT_BACKEND, else auto)")
    p.add_argument("--threads", type=count_arg(1), default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--malloc", default="cached", choices=["cached", "system"],
                   help="CPU allocator behaviour for timed runs: cached (freed memory reused, as with "
                        "jemalloc/tcmalloc) or system (glibc default: big blocks are fresh mmaps)")
    p.add_argument("--repeats", type=count_arg(1), default=3, help="timed runs per point (median)")
    p.add_argument("--quick", action="store_true", help="short smoke run (small lengths, fewer repeats)")
    p.add_argument("--seed", type=count_arg(0), default=0)
    p.add_argument("--out", default=out, help="folder for results.json, results.md and the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no printed table")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="base model: folder, hub id, .gguf or alias (default: a tiny random Llama built from a config)")
    p.add_argument("--converted", default=None,
                   help="a converted checkpoint folder to compare (default: convert --model in memory)")
    p.add_argument("--method", default="macchiato", help="conversion method when converting in memory")
    p.add_argument("--window", type=count_arg(1), default=None,
                   help="sliding window w of a windowed method (default: the method's, retrofit.layers.DEFAULT_WINDOW)")
    p.add_argument("--latents", type=count_arg(0), default=None,
                   help="latent states L in total over the query heads (default: "
                        "retrofit.bench.defaults.LATENTS_PER_HEAD per query head)")
    p.add_argument("--tiny-size", default="small", choices=["tiny", "small"],
                   help="built-in config when no --model: tiny (hidden 64, 2 layers) or small (hidden 256, 4 layers)")


def _suite(suites: argparse._SubParsersAction, name: str, *, help: str, description: str,
           lengths: str) -> argparse.ArgumentParser:
    """A suite's parser, opening with the flag every suite has: ``--lengths`` (``lengths``: its help)."""
    s = suites.add_parser(name, help=help, description=description)
    s.add_argument("--lengths", type=length_arg, nargs="+", default=None, metavar="L", help=lengths)
    return s


def _finish_suite(s: argparse.ArgumentParser, out: str, handler: Callable[[argparse.Namespace], int], *,
                  models: bool = True) -> None:
    """A suite's closing flags: the model flags (``models``: a suite that times whole models) and the
    flags every suite has (``out``: its default output folder), and its ``handler``."""
    if models:
        _model_args(s)
    _common(s, out)
    s.set_defaults(handler=handler)


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("bench", help=help_text, description=help_text,
                       epilog="retrofit bench SUITE --help for a suite's options.")
    suites = p.add_subparsers(dest="suite", metavar="SUITE")

    a = _suite(suites, "attention", help="attention ops vs PyTorch SDPA causal across sequence lengths",
               description="Forward and forward+backward time, peak memory and FLOP efficiency of causal Latte, "
                           "Macchiato, the sliding window and exp-linear against SDPA causal.",
               lengths="sequence lengths, 4096 or 4K (default 1K..32K; --quick: 1K 2K 4K)")
    a.add_argument("--batch", type=count_arg(1), default=1)
    a.add_argument("--heads", type=count_arg(1), default=8)
    a.add_argument("--head-dim", type=count_arg(1), default=256)
    a.add_argument("--latents", type=count_arg(1), default=None,
                   help="latent states L in total, split over --heads (L_h = L / heads), as in convert and "
                        "bench decode (default: retrofit.bench.defaults.LATENTS_PER_HEAD per head)")
    a.add_argument("--window", type=count_arg(1), default=None,
                   help="sliding window w (default: the methods' retrofit.layers.DEFAULT_WINDOW)")
    a.add_argument("--chunk-size", type=count_arg(1), default=None, help="chunk size for the chunked ops (default: op default)")
    a.add_argument("--ops", nargs="+", default=None, help="subset of: latte macchiato swa exp_linear delta sdpa")
    a.add_argument("--modes", nargs="+", default=None, choices=["fwd", "fwd+bwd"], help="default: both")
    a.add_argument("--sdpa-max-length", type=length_arg, default=32768, metavar="L",
                   help="skip SDPA above this length, 32768 or 32K (default 32K)")
    a.add_argument("--max-seconds", type=positive_float_arg, default=30.0,
                   help="time budget per point and mode: fewer timed runs when one run is slow")
    a.add_argument("--point-timeout", type=positive_float_arg, default=3600.0, help="give up on a point after this many seconds")
    a.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="measure in this process instead of a fresh worker per point (faster; memory less exact)")
    _finish_suite(a, "runs/bench/attention", _run_attention, models=False)

    d = _suite(suites, "decode", help="per-token decoding latency vs context length, converted vs base",
               description="Prefill a context of each length, then time single-token decoding steps with each "
                           "model's cache (retrofit's constant-memory cache for the converted one).",
               lengths="context lengths, 4096 or 4K (default 1K..32K; --quick: 256 512 1K)")
    d.add_argument("--new-tokens", type=count_arg(1), default=16,
                   help="timed decoding steps per length, at most 1048576 (1M)")
    d.add_argument("--prefill-chunk", type=count_arg(1), default=2048, help="prefill the context in chunks of this many tokens")
    d.add_argument("--batch", type=count_arg(1), default=1)
    d.add_argument("--compile", action="store_true",
                   help="decode the converted model through retrofit.decoding.CompiledDecoder (one compiled step, "
                        "weights frozen) and time the base both as it ships and compiled with a StaticCache")
    _finish_suite(d, "runs/bench/decode", _run_decode)

    m = _suite(suites, "model", help="whole-model prefill and training-step tokens/s, converted vs base",
               description="Prefill (no-grad forward) and training step (forward, backward, AdamW step) throughput "
                           "of a converted model and its base at several sequence lengths.",
               lengths="sequence lengths, 4096 or 4K (default 1K 2K 4K 8K; --quick: 256 512)")
    m.add_argument("--batch", type=count_arg(1), default=1)
    m.add_argument("--train-all", action="store_true",
                   help="train every weight of both models (default: base trains all, converted its new weights)")
    m.add_argument("--no-train", dest="train", action="store_false", help="prefill only")
    m.add_argument("--no-prefill", dest="prefill", action="store_false", help="training step only")
    m.add_argument("--no-memory", dest="memory", action="store_false",
                   help="times only: skip the pass of peak-memory runs (two runs per point, before the timed ones)")
    m.add_argument("--loss", choices=("model", "sliced"), default="model",
                   help="training loss: the model's own LM loss (default; whole (B, T, V) logits) or the same loss "
                        "through the trainer's sliced LM head (no whole logits; for long sequences)")
    m.add_argument("--base-attention", choices=("loaded", "retrofit"), default="loaded",
                   help="the base's attention: as transformers loads it (default; SDPA on CPU, whose native "
                        "sliding-window layers take a dense T x T mask) or the 'retrofit' implementation, which "
                        "runs those layers through the O(T w) banded kernel the converted model uses")
    m.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every decoder layer in the training step (the trainer's default)")
    _finish_suite(m, "runs/bench/model", _run_model)

    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def _apply_backend(args: argparse.Namespace) -> None:
    """Check ``--device`` (one error line, before any work) and apply ``--backend``."""
    from retrofit.cli.devices import check_device

    check_device(getattr(args, "device", None))
    converted = getattr(args, "converted", None)
    if converted is not None:  # a plain model here would be timed, and labelled, as the converted one
        from retrofit.errors import RetrofitError
        from retrofit.surgery.loading import names_converted

        if names_converted(converted) is False:
            raise RetrofitError(f"--converted {converted} is a plain model, not a converted checkpoint: pass a "
                                "folder retrofit convert wrote, or drop --converted to convert --model in memory")
    if getattr(args, "backend", None):
        from retrofit.ops.backends import set_default_backend

        set_default_backend(args.backend)


def _locked(args: argparse.Namespace):
    """``--out``'s output lock (the one convert, train and eval take): a second bench into the same folder
    is refused, naming the run that writes it, instead of both writing one results set. ``--out`` is never a
    model or checkpoint folder (results written there would make it one retrofit may no longer replace)."""
    from retrofit.fs import output_lock
    from retrofit.fs.guard import check_not_model_folder

    inputs = [getattr(args, "model", None), getattr(args, "converted", None)]
    return output_lock(check_not_model_folder(args.out, "--out", inputs))


def _run_attention(args: argparse.Namespace) -> int:
    from retrofit.bench.attention import run_attention_benchmark

    _apply_backend(args)
    with _locked(args):
        run_attention_benchmark(args)
    return 0


def _run_decode(args: argparse.Namespace) -> int:
    from retrofit.bench.decode import run_decode_benchmark
    from retrofit.eval.evaluators import check_new_tokens

    check_new_tokens("--new-tokens", args.new_tokens)
    _apply_backend(args)
    with _locked(args):
        run_decode_benchmark(args)
    return 0


def _run_model(args: argparse.Namespace) -> int:
    from retrofit.bench.model import run_model_benchmark

    _apply_backend(args)
    with _locked(args):
        run_model_benchmark(args)
    return 0
