"""`retrofit fit RECIPE.yaml [section.key=value ...]`: fit a converted model's read to the base, layer by layer.

    retrofit fit configs/smollm2-135m-hedgehog-fit-cpu.yaml
    retrofit fit configs/smollm2-135m-hedgehog-fit-cpu.yaml fit.maps.steps=0 model.name=runs/fit/final  # refit the scale

The recipe's model, conversion and data sections as for `retrofit train`, and its `fit` section
(retrofit.train.fit). The conversion's method must declare the `fit` capability on its config
(Hedgehog's does); another is refused with one error line naming the methods that can be fitted.
The fitted model is a delta checkpoint in --out (default: the recipe's checkpoint.output_dir +
/final) with the fit's report, fit.json; `retrofit eval`, `generate`, `bench` and `train`
(model.name=...) read it. While it fits, a progress bar on stderr shows the layer (i/N), the steps,
the loss and the time spent (none with -q or logging.progress=false), and a line per fitted layer
follows on stdout.
"""
from __future__ import annotations

import argparse

EPILOG = """\
overrides use dotted keys and YAML values, e.g. fit.maps.steps=300 fit.scale.seq_len=32768, or
model.name=DIR fit.maps.steps=0 to refit the scale of a fitted model (the sequences' lengths are
fit.maps.seq_len and fit.scale.seq_len; data.seq_len is not read). Recipes may be a path or a bundled name.
"""


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("fit", help=help_text, description=help_text, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe (a path, or the name of a bundled recipe)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides")
    p.add_argument("--out", default=None, help="output folder (default: checkpoint.output_dir/final; must not exist "
                                               "unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint folder (never the input model or the current directory)")
    p.add_argument("--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from retrofit.fs import check_replaceable, output_lock
    from retrofit.train.fit import check_fittable_recipe
    from retrofit.train.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if args.print_recipe:
        import yaml

        print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
        return 0
    check_fittable_recipe(recipe)  # a conversion of a method that cannot be fitted fails before anything loads
    out = Path(args.out) if args.out else Path(recipe.checkpoint.output_dir) / "final"
    check_replaceable(out, overwrite=args.overwrite, protect=[recipe.model.name])  # before any weight loads
    from retrofit.train.data import data_files

    data_files(recipe)  # a bad data path fails now, not after the model loads
    with output_lock(out):
        check_replaceable(out, overwrite=args.overwrite, protect=[recipe.model.name])
        return _fit(args, recipe, out)


def _fit(args: argparse.Namespace, recipe, out) -> int:
    import time

    from retrofit.train.fit import run_fit

    say = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    start = time.time()
    report = run_fit(recipe, out, overwrite=args.overwrite, log=say, progress=not args.quiet)
    if not args.quiet:
        print(report.table())
        print(f"[retrofit] done in {(time.time() - start) / 60:.1f} min; fitted model in {out} (its report: {out / 'fit.json'})")
    return 0
