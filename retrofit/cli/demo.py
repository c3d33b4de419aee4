"""`retrofit demo`: a recipe's whole job end to end on a real model (default: Gemma 3 270M; see retrofit/demo.py)."""
from __future__ import annotations

import argparse

DESCRIPTION = """\
Run a recipe's whole job on a real model into one folder (--out): load the base model,
convert it, train its new weights (or, for a recipe with a fit section, fit them layer by
layer as retrofit fit does), evaluate it beside the base (perplexity vs length, passkey
retrieval, zero-shot baselines), generate a continuation through the retrofit cache, and
write report.md, whose path it prints last.

Default: the recipe {default} (Gemma 3 270M, global layer 17 as Latte
Macchiato, the retrieval layers kept as RoPE-capped full attention), trained briefly on the
bundled public-domain books. Any bundled recipe (retrofit ls recipes) or recipe file runs the
same way (--recipe); --quick is the few-minute variant."""

EPILOG = """\
examples:
  retrofit demo --quick
  retrofit demo --recipe smollm2-135m-hedgehog-fit-cpu --out runs/demo-smollm2
  retrofit demo --lengths 1K 4K 32K 64K train.lr=1e-3
"""


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    from retrofit.demo import DEFAULT_RECIPE
    from retrofit.eval.evaluators import length_arg

    default = DEFAULT_RECIPE.removesuffix(".yaml")
    p = sub.add_parser("demo", help=help_text, description=DESCRIPTION.format(default=default), epilog=EPILOG)
    p.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    p.add_argument("--quick", action="store_true", help="the ~5 minute variant (fewer steps, shorter lengths)")
    p.add_argument("--model", default=None, help="model to convert (default: the recipe's model.name)")
    p.add_argument("--recipe", default=None,
                   help=f"recipe, a bundled name (retrofit ls recipes) or a path (default: {default}; "
                        "smollm2-135m-hedgehog-fit-cpu converts every layer of SmolLM2-135M and fits its read "
                        "layer by layer instead of training it)")
    p.add_argument("--zero-shot", nargs="+", default=None, metavar="VARIANT",
                   help="zero-shot baselines scored beside the two (as retrofit eval --zero-shot; 'none' for none; "
                        "default: closed, plus cap:<base context - 1> when a length goes past the base's context)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides the preset)")
    p.add_argument("--seq-len", type=int, default=None, help="training sequence length (overrides the preset)")
    p.add_argument("--lengths", type=length_arg, nargs="+", default=None, metavar="L",
                   help="perplexity lengths, e.g. 1K 4K 32K 64K (default: 1K 4K 8K 16K 32K; --quick: 512 1K); "
                        "a length past the base's context adds the capped base")
    p.add_argument("--eval-dtype", choices=["auto", "float32", "bfloat16"], default=None,
                   help="dtype both models are scored in (default: auto = bfloat16 where the CPU/GPU has native "
                        "bf16 matmuls, else float32)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. train.lr=1e-3")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from retrofit.demo import DemoSettings, run_demo

    s = DemoSettings.quick() if args.quick else DemoSettings.full()
    if args.model:
        s.model = args.model
    if args.recipe:
        s.recipe = args.recipe
    if args.steps is not None:
        s.train_steps = args.steps
    if args.seq_len is not None:
        s.seq_len = args.seq_len
    if args.lengths:
        s.ppl_lengths = args.lengths
    if args.eval_dtype:
        s.eval_dtype = args.eval_dtype
    if args.zero_shot is not None:
        s.zero_shot = [] if args.zero_shot == ["none"] else list(args.zero_shot)
    s.training_flags = [flag for flag, value in (("--steps", args.steps), ("--seq-len", args.seq_len)) if value is not None]
    s.overrides = list(args.overrides)
    run_demo(args.out, s)
    return 0
