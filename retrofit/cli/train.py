"""`retrofit train RECIPE.yaml [section.key=value ...]`.

One GPU or the CPU::

    retrofit train configs/gemma3-270m-macchiato-cpu.yaml train.max_steps=50

Many GPUs / nodes (see scripts/pretrain.sh)::

    torchrun --nproc_per_node 4 -m retrofit.cli.main train configs/gemma2-2b-macchiato.yaml
    deepspeed --no_local_rank --num_gpus 4 --module retrofit.cli.main train configs/gemma2-2b-macchiato.yaml
"""
from __future__ import annotations

import argparse

EPILOG = """\
overrides use dotted keys and YAML values, e.g. train.lr=1e-4 data.seq_len=1024 trainable.mode=lora
checkpoint.resume=none. Recipes may be a path or the name of a bundled one (retrofit/configs).
Launch under torchrun or deepspeed (with --no_local_rank) for several GPUs; a plain process runs one rank.
"""


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("train", help=help_text, description=help_text, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe (a path, or the name of a bundled recipe)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides")
    p.add_argument("--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from retrofit.train.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    from retrofit.errors import SpecError
    from retrofit.train.recipe import FitSection

    if recipe.fit != FitSection():
        raise SpecError(f"{args.recipe} has a fit section: it fits a Hedgehog read with retrofit fit (run "
                        f"'retrofit fit {args.recipe}'); to train the fitted model, set model.name to its folder in a "
                        "training recipe")
    if args.print_recipe:
        import yaml

        print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
        return 0
    from retrofit.extras import require

    for module in ("accelerate", "deepspeed"):  # before any model loads: one line naming the extra
        require(module, "retrofit train")
    if recipe.trainable.mode == "lora":
        require("peft", "trainable.mode: lora")
    from retrofit.train.entry import train

    result = train(recipe)
    if result.final_dir is not None and not args.quiet:
        print(f"[retrofit] done: {result.steps} steps, {result.tokens:,} tokens; model in {result.final_dir}")
    return 0
