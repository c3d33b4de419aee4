"""``retrofit eval ppl``: perplexity against context length, beside a baseline (paper Table 4)."""
from __future__ import annotations

import argparse

from retrofit.eval.evaluators import Evaluator, count_arg, length_arg, register_evaluator


def add_arguments(p: argparse.ArgumentParser, prefix: str) -> None:
    g = p.add_argument_group("perplexity")
    g.add_argument(f"--{prefix}lengths", dest="ppl_lengths", type=length_arg, nargs="+", default=[4096, 8192, 16384],
                   metavar="L", help="window lengths in tokens (4096 or 4K; default 4K 8K 16K)")
    g.add_argument("--datasets", nargs="+", default=["pg-books"], metavar="NAME",
                   help="registry names (configs/datasets.yaml: slimpajama, pile, openwebtext, tinystories, "
                        "pg19, pg-books, ...) or local .txt/.jsonl files/folders (default: pg-books)")
    g.add_argument("--protocol", choices=("windows", "packed"),
                   help="windows: exact-length windows inside long documents (PG-19 style); packed: "
                        "documents joined with separators. Default: each dataset's registry setting")
    g.add_argument("--max-windows", type=count_arg(0), default=8, help="cap on windows per dataset and length; 0 = all")
    g.add_argument("--max-docs", type=count_arg(1), help="stop reading a corpus after this many documents")
    g.add_argument("--chunk-size", type=count_arg(1),
                   help="forward MODEL this many tokens at a time through its cache (bounded memory)")
    g.add_argument("--baseline-chunk-size", type=count_arg(1), help="the same for the baseline (default: one forward)")
    g.add_argument("--logit-budget-mb", type=count_arg(1), default=256,
                   help="fp32 logits held at once; sets the lm_head slice size (default 256 MiB)")
    g.add_argument("--text-field", help="record field holding the text (jsonl / hub rows)")
    g.add_argument("--no-reuse-prefixes", dest="reuse_prefixes", action="store_false",
                   help="run every window on its own (default: a window that begins a longer one, e.g. the "
                        "first window of a book at each length, reuses that window's per-token NLLs)")


def kwargs(args: argparse.Namespace) -> dict:
    return dict(
        datasets=args.datasets, lengths=args.ppl_lengths, protocol=args.protocol,
        max_windows=args.max_windows or None, max_docs=args.max_docs, bos=args.bos,
        chunk_size=args.chunk_size, baseline_chunk_size=args.baseline_chunk_size,
        logit_budget=args.logit_budget_mb * (1 << 20) // 4, text_field=args.text_field,
        progress=not args.quiet, reuse_prefixes=args.reuse_prefixes,
    )


def check(args: argparse.Namespace) -> None:
    from retrofit.errors import RetrofitError

    if "perplexity" in (getattr(args, "skip", None) or ()):
        return
    short = sorted(L for L in args.ppl_lengths if L < 3)
    if short and getattr(args, "bos", "auto") != "never":
        raise RetrofitError(f"window length {short[0]} is too short: a window may start with BOS (--bos "
                            f"{getattr(args, 'bos', 'auto')}) and then needs 3 tokens or more to score any; give "
                            "lengths of 3 or more, or --bos never")


EVALUATOR = register_evaluator(Evaluator(
    name="perplexity", command="ppl", subdir="ppl", heading="Long-context perplexity",
    help="perplexity vs context length, beside a baseline (paper Table 4)",
    add_arguments=add_arguments, kwargs=kwargs, run="retrofit.eval.perplexity:run_perplexity", check=check,
    uses_bos=True, reads_text=True, order=10,
))
