"""`retrofit eval`: ppl | harness | passkey | all.

    retrofit eval ppl MODEL [--baseline BASE] --lengths 4096 8192 16384 --datasets pg-books slimpajama
    retrofit eval harness MODEL [--baseline BASE] --tasks mmlu,hellaswag,lambada_openai,arc_challenge,...
    retrofit eval passkey MODEL [--baseline BASE] --lengths 1024 4096 16384 --depths 0 0.25 0.5 0.75 1
    retrofit eval all MODEL --baseline BASE --out runs/eval/report

MODEL / BASE: a converted checkpoint folder, a base HF folder or hub id, a .gguf file, or
`gemma3-270m`. Each command writes results.json, table.md and PNGs into --out and prints its table.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

_PAPER_TASKS = "mmlu,hellaswag,lambada_openai,arc_challenge,arc_easy,winogrande,piqa,boolq"


def _length(text: str) -> int:
    """'4096', '4K', '4k', '32K' -> tokens."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (use 4096 or 4K)")
    value = float(m.group(1)) * (1024 if m.group(2) else 1)
    if value != int(value) or value < 2:
        raise argparse.ArgumentTypeError(f"not a whole number of tokens >= 2: {text!r}")
    return int(value)


def _depth(text: str) -> float:
    d = float(text)
    if not 0.0 <= d <= 1.0:
        raise argparse.ArgumentTypeError(f"depth {text} must be in [0, 1]")
    return d


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="converted folder, HF folder/hub id, .gguf file or gemma3-270m")
    p.add_argument("--baseline", metavar="BASE", help="a model to evaluate beside MODEL (e.g. its base model)")
    p.add_argument("--out", type=Path, help="output folder (default: runs/eval/<model>/<command>)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the models (default: as loaded)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--text-errors", choices=("strict", "replace"), default="strict",
                   help="local text that is not UTF-8: strict = error naming file and byte offset (default), "
                        "replace = decode bad bytes as U+FFFD (the same policy as data.text_errors in training)")
    p.add_argument("--json", action="store_true",
                   help="print the results (as in results.json) as JSON on stdout instead of the table")


def _ppl_args(p: argparse.ArgumentParser, lengths_flag: str = "--lengths") -> None:
    g = p.add_argument_group("perplexity")
    g.add_argument(lengths_flag, dest="ppl_lengths", type=_length, nargs="+", default=[4096, 8192, 16384], metavar="L",
                   help="window lengths in tokens (4096 or 4K; default 4K 8K 16K)")
    g.add_argument("--datasets", nargs="+", default=["pg-books"], metavar="NAME",
                   help="registry names (configs/datasets.yaml: slimpajama, pile, openwebtext, tinystories, "
                        "pg19, pg-books, ...) or local .txt/.jsonl files/folders (default: pg-books)")
    g.add_argument("--protocol", choices=("windows", "packed"),
                   help="windows: exact-length windows inside long documents (PG-19 style); packed: "
                        "documents joined with separators. Default: each dataset's registry setting")
    g.add_argument("--max-windows", type=int, default=8, help="cap on windows per dataset and length; 0 = all")
    g.add_argument("--max-docs", type=int, help="stop reading a corpus after this many documents")
    g.add_argument("--chunk-size", type=int,
                   help="forward MODEL this many tokens at a time through its cache (bounded memory)")
    g.add_argument("--baseline-chunk-size", type=int, help="the same for the baseline (default: one forward)")
    g.add_argument("--logit-budget-mb", type=int, default=256,
                   help="fp32 logits held at once; sets the lm_head slice size (default 256 MiB)")
    g.add_argument("--text-field", help="record field holding the text (jsonl / hub rows)")
    g.add_argument("--no-reuse-prefixes", dest="reuse_prefixes", action="store_false",
                   help="run every window on its own (default: a window that begins a longer one, e.g. the "
                        "first window of a book at each length, reuses that window's per-token NLLs)")


def _harness_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("lm-eval")
    g.add_argument("--tasks", default=_PAPER_TASKS, help=f"comma-separated lm-eval tasks (default: {_PAPER_TASKS})")
    g.add_argument("--num-fewshot",
                   help="N for every task, or task=N,... (default: the paper-table map in retrofit.eval.harness)")
    g.add_argument("--limit", type=float, help="examples per task (smoke runs; <1 = fraction)")
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--max-length", type=int, help="lm-eval context limit (default: from the model config)")
    g.add_argument("--include-path", nargs="+", default=[], help="extra folders of lm-eval task YAMLs")
    g.add_argument("--bootstrap-iters", type=int, default=1000, help="bootstrap samples for stderr (0 = none)")


def _passkey_args(p: argparse.ArgumentParser, lengths_flag: str = "--lengths") -> None:
    g = p.add_argument_group("passkey")
    g.add_argument(lengths_flag, dest="passkey_lengths", type=_length, nargs="+", metavar="L",
                   default=[1024, 2048, 4096, 8192, 16384, 32768], help="prompt lengths (default 1K..32K)")
    g.add_argument("--depths", type=_depth, nargs="+", metavar="D", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths in [0, 1] (default 0 0.25 0.5 0.75 1)")
    g.add_argument("--trials", type=int, default=5, help="prompts per (length, depth) cell")
    g.add_argument("--haystack", default="pg-books", help="corpus for the filler text (default pg-books)")
    g.add_argument("--key-digits", type=int, default=5)


def _shared(p: argparse.ArgumentParser, bos: bool = True, seed: bool = True) -> None:
    if seed:
        p.add_argument("--seed", type=int, default=0, help="seed for few-shot sampling and passkey keys")
    if bos:
        p.add_argument("--bos", choices=("auto", "always", "never"), default="auto",
                       help="start sequences with BOS (auto: as the tokenizer does; always for Gemma)")


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("eval", help=help_text, description=help_text)
    evsub = p.add_subparsers(dest="eval_command", metavar="COMMAND")
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])

    pp = evsub.add_parser("ppl", help="perplexity vs context length, beside a baseline (paper Table 4)")
    _common(pp)
    _ppl_args(pp)
    _shared(pp, seed=False)
    pp.set_defaults(handler=_run_ppl)

    ph = evsub.add_parser("harness", help="lm-eval few-shot benchmarks (paper Table 5)")
    _common(ph)
    _harness_args(ph)
    _shared(ph, bos=False)
    ph.set_defaults(handler=_run_harness)

    pk = evsub.add_parser("passkey", help="passkey retrieval over lengths x depths (heat map)")
    _common(pk)
    _passkey_args(pk)
    _shared(pk)
    pk.set_defaults(handler=_run_passkey)

    pa = evsub.add_parser("all", help="perplexity + lm-eval + passkey, and one markdown report")
    _common(pa)
    _ppl_args(pa, "--ppl-lengths")
    _harness_args(pa)
    _passkey_args(pa, "--passkey-lengths")
    _shared(pa)
    pa.add_argument("--skip", nargs="+", default=[], choices=("perplexity", "harness", "passkey"),
                    help="sections to leave out")
    pa.set_defaults(handler=_run_all)


def _out(args: argparse.Namespace, name: str) -> Path:
    from retrofit.cli.devices import check_device
    from retrofit.fs import check_output_folder

    check_device(args.device)  # every eval command calls _out first: bad flags fail before any model loads
    if getattr(args, "num_fewshot", None) is not None:
        from retrofit.eval.harness import parse_fewshot

        parse_fewshot(args.num_fewshot)
    if args.out is not None:
        return check_output_folder(args.out)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(args.model).rstrip("/")).name) or "model"
    return check_output_folder(Path("runs") / "eval" / slug / name)


def _text_policy(args: argparse.Namespace):
    from retrofit.data.text import text_errors

    return text_errors(getattr(args, "text_errors", "strict"))


def _command() -> str | None:
    if Path(sys.argv[0]).name in ("retrofit", "main.py", "__main__.py"):
        return "retrofit " + shlex.join(sys.argv[1:])
    return None


def _ppl_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        datasets=args.datasets, lengths=args.ppl_lengths, protocol=args.protocol,
        max_windows=args.max_windows or None, max_docs=args.max_docs, bos=args.bos,
        chunk_size=args.chunk_size, baseline_chunk_size=args.baseline_chunk_size,
        logit_budget=args.logit_budget_mb * (1 << 20) // 4, text_field=args.text_field,
        progress=not args.quiet, reuse_prefixes=args.reuse_prefixes,
    )


def _harness_kwargs(args: argparse.Namespace) -> dict:
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    return dict(
        tasks=args.tasks, num_fewshot=args.num_fewshot, limit=limit, batch_size=args.batch_size,
        max_length=args.max_length, include_path=args.include_path, bootstrap_iters=args.bootstrap_iters,
        seed=args.seed,
    )


def _passkey_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        lengths=args.passkey_lengths, depths=args.depths, trials=args.trials, haystack=args.haystack,
        key_digits=args.key_digits, seed=args.seed, bos=args.bos, progress=not args.quiet,
    )


def _finish(res: dict, out: Path, as_json: bool = False) -> int:
    if as_json:
        import json

        from retrofit.cli.common import print_json

        print_json(json.loads((out / "results.json").read_text()))
        return 0
    print()
    print(res["table"])
    print(f"\nwrote {out}/results.json, {out}/table.md" + "".join(f", {out}/{i}" for i in res.get("images", [])))
    return 0


def _run_ppl(args: argparse.Namespace) -> int:
    from retrofit.eval.perplexity import run_perplexity

    out = _out(args, "ppl")
    with _text_policy(args):
        res = run_perplexity(args.model, baseline=args.baseline, device=args.device, dtype=args.dtype, out=out,
                             command=_command(), **_ppl_kwargs(args))
    return _finish(res, out, args.json)


def _run_harness(args: argparse.Namespace) -> int:
    from retrofit.eval.harness import run_harness

    out = _out(args, "harness")
    res = run_harness(args.model, baseline=args.baseline, device=args.device, dtype=args.dtype, out=out,
                      command=_command(), **_harness_kwargs(args))
    return _finish(res, out, args.json)


def _run_passkey(args: argparse.Namespace) -> int:
    from retrofit.eval.passkey import run_passkey

    out = _out(args, "passkey")
    with _text_policy(args):
        res = run_passkey(args.model, baseline=args.baseline, device=args.device, dtype=args.dtype, out=out,
                          command=_command(), **_passkey_kwargs(args))
    return _finish(res, out, args.json)


def _run_all(args: argparse.Namespace) -> int:
    from retrofit.eval.suite import run_all

    out = _out(args, "all")
    with _text_policy(args):
        res = _run_all_sections(args, out)
    if args.json:
        from retrofit.cli.common import print_json

        print_json({"report": str(res["report"]), **{k: v for k, v in res.items() if k not in ("report", "markdown")}})
        return 0
    print()
    print(res["markdown"])
    print(f"wrote {res['report']}")
    return 0


def _run_all_sections(args: argparse.Namespace, out: Path) -> dict:
    from retrofit.eval.suite import run_all

    return run_all(
        args.model, baseline=args.baseline, out=out, skip=args.skip, device=args.device, dtype=args.dtype,
        perplexity=_ppl_kwargs(args), harness=_harness_kwargs(args), passkey=_passkey_kwargs(args),
        command=_command(),
    )
