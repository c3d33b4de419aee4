"""`retrofit eval COMMAND`: one command per registered evaluator (retrofit.eval.evaluators), plus all.

    retrofit eval ppl MODEL [--baseline BASE] --lengths 4K 8K 16K --datasets pg-books slimpajama
    retrofit eval harness MODEL [--baseline BASE] --tasks mmlu,hellaswag,lambada_openai,arc_challenge,...
    retrofit eval passkey MODEL [--baseline BASE] --lengths 1K 4K 16K --depths 0 0.25 0.5 0.75 1
    retrofit eval niah MODEL [--baseline BASE] --lengths 1K 4K 16K
    retrofit eval ruler MODEL [--baseline BASE] --lengths 4K 16K --samples 20
    retrofit eval all MODEL --baseline BASE --out runs/eval/report

MODEL / BASE: a converted checkpoint folder, a base HF folder or hub id, a .gguf file, or
an alias (`retrofit ls models`). Each command writes results.json, table.md and PNGs into --out and prints its table.
--out is never a model folder, and a folder that holds earlier results is replaced only with --overwrite
(the default folder runs/eval/<model>/<command> moves on to <command>-2, -3, ... instead).
The help texts list the commands from the registry, so a kind registered there shows up in them.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import sys
from pathlib import Path

from retrofit.errors import RetrofitError
from retrofit.eval.evaluators import Evaluator, evaluators, get_evaluator
from retrofit.eval.variants import takes_zero_shot


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="converted folder, HF folder/hub id, .gguf file or alias (gemma3-270m, smollm2-135m)")
    p.add_argument("--baseline", metavar="BASE", help="a model to evaluate beside MODEL (e.g. its base model)")
    p.add_argument("--out", type=Path, help="output folder (default: runs/eval/<model>/<command>, or <command>-2, "
                                          "-3, ... when that holds results); never a model folder, and one holding "
                                          "earlier results only with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results (results.json, table.md, report.md, plots) already in --out")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="cast the models (default: as loaded; auto: bfloat16 where the device has native bf16 "
                        "matmuls, e.g. AVX512-BF16/AMX CPUs, else float32)")
    p.add_argument("--rope-cap", type=int, default=None, metavar="TOKENS",
                   help="cap the RoPE distance of MODEL's and BASE's full-attention layers at TOKENS (ReRoPE-style: "
                        "farther pairs scored at TOKENS; e.g. 32767 for a base pretrained at 32K; 0 removes a "
                        "converted model's cap; default: as loaded)")
    p.add_argument("--zero-shot", nargs="+", default=[], metavar="VARIANT",
                   help="zero-shot baselines scored beside MODEL and BASE in the same table: yarn:F, dynamic:F, "
                        "linear:F (transformers' RoPE scaling of BASE by factor F), cap:N (BASE's RoPE distance "
                        "capped at N; without --baseline, an unconverted MODEL is the base they change), "
                        "closed (MODEL with its latent path closed: the frozen window and sinks alone, i.e. "
                        "StreamingLLM), tier:N, tier-norm:N, tier-recency:N (a Hedgehog MODEL with an exact tier "
                        "of N tokens per KV head beside its window, chosen by self-recall error, key norm or "
                        "recency); e.g. --zero-shot yarn:4 dynamic:4 cap:8191 closed")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--text-errors", choices=("strict", "replace"), default="strict",
                   help="local text that is not UTF-8: strict = error naming file and byte offset (default), "
                        "replace = decode bad bytes as U+FFFD (the same policy as data.text_errors in training)")
    p.add_argument("--json", action="store_true",
                   help="print the results (as in results.json) as JSON on stdout instead of the table")


def _shared(p: argparse.ArgumentParser, bos: bool = True, seed: bool = True) -> None:
    if seed:
        p.add_argument("--seed", type=int, default=0, help="seed for few-shot sampling and passkey keys")
    if bos:
        p.add_argument("--bos", choices=("auto", "always", "never"), default="auto",
                       help="start sequences with BOS (auto: as the tokenizer does; always for Gemma)")


def commands_help(help_text: str, kinds: list[Evaluator]) -> str:
    """``help_text`` followed by the registered commands: the verb's line in ``retrofit --help``."""
    return f"{help_text}: " + ", ".join(ev.command for ev in kinds) + ", or all of them"


EPILOG = "retrofit eval COMMAND --help for a command's options (retrofit eval all --help: its prefixed flags)."


def _all_help(kinds: list[Evaluator]) -> str:
    return " + ".join(ev.label or ev.name for ev in kinds) + ", and one markdown report"


def prefixed_flags(parser: argparse.ArgumentParser, kinds: list[Evaluator]) -> dict[str, list[str]]:
    """``eval all``'s flags that carry a command's prefix (``--ppl-lengths``), by command."""
    flags = [o for action in parser._actions for o in action.option_strings]
    return {ev.command: [f for f in flags if f.startswith(f"--{ev.command}-")] for ev in kinds}


def _all_epilog(parser: argparse.ArgumentParser, kinds: list[Evaluator]) -> str:
    """What ``retrofit eval all --help`` ends with: its prefixed flags, read from ``parser``."""
    import textwrap

    by_command = {c: f for c, f in prefixed_flags(parser, kinds).items() if f}
    width = max(map(len, by_command), default=0) + 1
    lines = ["prefixed flags: here these flags of the single commands take the command's name as a prefix",
             "(--ppl-lengths is retrofit eval ppl --lengths; retrofit eval COMMAND --help says what each means):"]
    lines += [textwrap.fill(" ".join(f), 100, initial_indent=f"  {c + ':':<{width}} ", subsequent_indent=" " * (width + 3))
              for c, f in by_command.items()]
    lines += ["The other flags keep their names (e.g. --datasets, --tasks, --depths); --chat-template and",
              "--prefill-chunk apply to every generation-scored command alike.",
              "",
              "example: retrofit eval all MODEL --baseline BASE --ppl-lengths 4K 16K --passkey-lengths 1K 4K \\",
              "             --ruler-samples 2 --skip harness"]
    return "\n".join(lines)


def _fits(kinds: list[Evaluator], every: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Build the flags of ``kinds[-1]``'s own command, and of ``eval all`` with every one of ``kinds`` (onto
    ``every``, a scratch ``eval all`` parser holding the kinds before it); raises whatever a clash raises."""
    ev = kinds[-1]
    one = argparse.ArgumentParser()
    _common(one)
    ev.add_arguments(one, "")
    _shared(one, bos=ev.uses_bos, seed=ev.uses_seed)
    if every is None:
        every = argparse.ArgumentParser()
        _common(every)
        for k in kinds[:-1]:
            k.add_arguments(every, f"{k.command}-")
    ev.add_arguments(every, f"{ev.command}-")
    final = argparse.ArgumentParser(parents=[every], add_help=False)  # what _shared and --skip then add
    _shared(final, bos=True, seed=True)
    final.add_argument("--skip")
    return every


def _usable(kinds: list[Evaluator]) -> list[Evaluator]:
    """The kinds whose flags fit the CLI. A kind (a plugin) whose ``add_arguments`` clashes with the common
    flags or another kind's, or fails at all, is reported in one warning line and dropped from the
    registry, so every verb (and ``--help``) still works."""
    from retrofit.eval.evaluators import unregister_evaluator
    from retrofit.plugins import report_broken

    ok: list[Evaluator] = []
    every = None
    for ev in kinds:
        try:
            every = _fits(ok + [ev], every)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            every = None  # it may have added part of its flags: rebuild from the kinds kept
            unregister_evaluator(ev.name)
            report_broken(f"evaluator {ev.name!r} (retrofit eval {ev.command}): its flags do not fit the CLI; it is",
                          exc)
            continue
        ok.append(ev)
    return ok


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    """``retrofit eval COMMAND``: one sub-command per registered evaluator, plus ``all``."""
    kinds = _usable(evaluators())
    summary = commands_help(help_text, kinds)
    p = sub.add_parser("eval", help=summary, description=summary, epilog=EPILOG)
    evsub = p.add_subparsers(dest="eval_command", metavar="COMMAND")
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])
    for ev in kinds:
        pe = evsub.add_parser(ev.command, help=ev.help)
        _common(pe)
        ev.add_arguments(pe, "")
        _shared(pe, bos=ev.uses_bos, seed=ev.uses_seed)
        pe.set_defaults(handler=_run_one, evaluator=ev.name)

    names = [ev.name for ev in kinds]
    pa = evsub.add_parser("all", help=_all_help(kinds), description=_all_help(kinds) + " (report.md in --out)")
    _common(pa)
    for ev in kinds:
        ev.add_arguments(pa, f"{ev.command}-")
    _shared(pa, bos=any(ev.uses_bos for ev in kinds), seed=any(ev.uses_seed for ev in kinds))
    pa.add_argument("--skip", nargs="+", default=[], choices=names, help="sections to leave out")
    pa.epilog = _all_epilog(pa, kinds)
    pa.set_defaults(handler=_run_all)


def _out(args: argparse.Namespace, name: str) -> Path:
    from retrofit.cli.devices import check_device
    from retrofit.eval.variants import parse_variants
    from retrofit.fs import check_output_folder, special_kind
    from retrofit.surgery.loading import names_converted

    check_device(args.device)  # every eval command calls _out first: bad flags fail before any model loads
    variants = parse_variants(args.zero_shot)
    on_base = [v.spec for v in variants if v.applies_to == "baseline"]
    if on_base and not args.baseline and names_converted(args.model):  # an unconverted MODEL is the base they change
        raise RetrofitError("--zero-shot " + " ".join(on_base) + " changes the base model, and MODEL is converted: "
                            "pass the base with --baseline BASE")
    if args.zero_shot and name != "all" and not takes_zero_shot(get_evaluator(args.evaluator).runner()):
        raise RetrofitError(f"retrofit eval {name} does not score zero-shot variants; drop --zero-shot")
    for flag, attr in _DATA_FLAGS:  # an empty path is the current folder: every text file in it would be read
        items = getattr(args, attr, None)
        if any(isinstance(item, str) and not item.strip() for item in (
                items if isinstance(items, (list, tuple)) else [items])):
            flag = flag if name == "all" else "--" + flag.split("-")[-1]  # eval niah's --haystack, not --niah-haystack
            raise RetrofitError(f"{flag} holds an empty name; give a dataset name (retrofit ls datasets) or a path "
                                "to .txt/.jsonl files")
        for item in items if isinstance(items, (list, tuple)) else [items]:
            kind = special_kind(item) if isinstance(item, str) else None
            if kind:  # /dev/null, a pipe: found only after the models load, as a folder without text files
                flag = flag if name == "all" else "--" + flag.split("-")[-1]
                raise RetrofitError(f"{flag} {item} is {kind}; give a dataset name (retrofit ls datasets) or a path "
                                    "to .txt/.jsonl files or a folder of them")
    for ev in evaluators():
        if ev.check is not None and (name == "all" or ev.command == name):
            ev.check(args)
    if args.out is not None:
        out = check_output_folder(args.out)
    else:  # the default folder keeps earlier runs too: the next free <command>-2, -3, ... (--overwrite: replace)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(args.model).rstrip("/")).name) or "model"
        first = out = Path("runs") / "eval" / slug / name
        n = 1
        while not getattr(args, "overwrite", False) and out.is_dir() and _earlier_results(out):
            n += 1
            out = first.with_name(f"{name}-{n}")
        out = check_output_folder(out)
    _check_results_folder(out, args)
    return out


# what a model folder holds (transformers, PEFT, GGUF); eval results never go into one
_MODEL_FILES = ("config.json", "adapter_config.json", "*.safetensors", "pytorch_model*.bin", "*.gguf")
# the flags naming local text folders an eval reads (eval all's prefixed ones too)
_DATA_FLAGS = (("--datasets", "datasets"), ("--haystack", "haystack"), ("--niah-haystack", "niah_haystack"),
               ("--ruler-haystack", "ruler_haystack"))
# what an eval command writes into --out (eval all: report.md and one sub-folder per section)
_RESULT_FILES = ("results.json", "table.md", "report.md", "*/results.json")


def _earlier_results(folder: Path) -> list[str]:
    return sorted(str(f.relative_to(folder)) for pat in _RESULT_FILES for f in folder.glob(pat))


def _check_results_folder(out: Path, args: argparse.Namespace) -> None:
    """Before any model loads: ``out`` is no model folder nor inside MODEL / BASE, holds no earlier
    results unless ``--overwrite``, and can be written (a 20-minute run must not fail at its last step)."""
    import os
    import tempfile

    real = Path(os.path.realpath(out))
    for role, item in (("MODEL", args.model), ("BASE", args.baseline)):
        p = Path(os.path.expanduser(str(item))) if item else None
        if p is not None and p.is_dir() and (real == p.resolve() or p.resolve() in real.parents):
            where = "is" if real == p.resolve() else "lies inside"
            raise RetrofitError(f"--out {out} {where} the model folder {item} ({role}); eval results never go "
                                "into a model folder: choose an output folder elsewhere")
    for flag, attr in _DATA_FLAGS:  # a later run would read these results as its text
        items = getattr(args, attr, None)
        for item in items if isinstance(items, (list, tuple)) else [items]:
            p = Path(os.path.expanduser(str(item))) if item else None
            if p is not None and p.is_dir() and (real == p.resolve() or p.resolve() in real.parents):
                raise RetrofitError(f"--out {out} lies in the data folder {item} ({flag}): the next run over it would "
                                    "read these results as text; choose an output folder elsewhere")
    if out.is_dir():
        model = [f.name for pat in _MODEL_FILES for f in out.glob(pat)]
        if model:
            raise RetrofitError(f"--out {out} holds a model ({', '.join(sorted(model)[:3])}); eval results never go "
                                "into a model folder: choose an output folder elsewhere")
        earlier = _earlier_results(out)
        if earlier and not getattr(args, "overwrite", False):
            raise RetrofitError(f"--out {out} already holds results ({', '.join(earlier[:3])}); pass --overwrite "
                                "to replace them or choose another output folder")
    probe = out
    while not probe.exists() and probe != probe.parent:  # the folder the first mkdir will write into
        probe = probe.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".retrofit-write-test-", dir=probe.absolute())
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise RetrofitError(f"--out {out} cannot be written ({probe} refuses a new file: "
                            f"{exc.strerror or exc}); choose a writable output folder") from None


def _text_policy(args: argparse.Namespace):
    from retrofit.data.text import text_errors

    return text_errors(getattr(args, "text_errors", "strict"))


def _command() -> str | None:
    if Path(sys.argv[0]).name in ("retrofit", "main.py", "__main__.py"):
        return "retrofit " + shlex.join(sys.argv[1:])
    return None


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


@contextlib.contextmanager
def _locked(out: Path, args: argparse.Namespace):
    """Hold ``out``'s output lock (the one convert and train take): a second eval into the same folder is
    refused, naming the run that writes it, instead of both succeeding and one losing its results."""
    from retrofit.fs import output_lock

    with output_lock(out):
        _check_results_folder(out, args)  # results a run finished meanwhile are not replaced without --overwrite
        yield


def _run_one(args: argparse.Namespace) -> int:
    ev: Evaluator = get_evaluator(args.evaluator)
    out = _out(args, ev.command)
    runner = ev.runner()
    zero_shot = {"zero_shot": args.zero_shot} if takes_zero_shot(runner) else {}
    with _locked(out, args), _text_policy(args) if ev.reads_text else contextlib.nullcontext():
        res = runner(args.model, baseline=args.baseline, device=args.device, dtype=args.dtype, out=out,
                     rope_cap=args.rope_cap, command=_command(), **zero_shot, **ev.kwargs(args))
    return _finish(res, out, args.json)


def _run_all(args: argparse.Namespace) -> int:
    out = _out(args, "all")
    with _locked(out, args), _text_policy(args):
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
        rope_cap=args.rope_cap, command=_command(), zero_shot=args.zero_shot,
        **{ev.name: ev.kwargs(args) for ev in evaluators() if ev.name not in args.skip},
    )
