"""`retrofit ls [KIND]`: the bundled recipes, convert specs, datasets, DeepSpeed configs and model aliases."""
from __future__ import annotations

import argparse

_USE = {
    "recipes": "retrofit train NAME [section.key=value ...]",
    "convert specs": "retrofit convert MODEL --config NAME --out DIR",
    "datasets": "retrofit eval ppl MODEL --datasets NAME",
    "deepspeed": "recipe key deepspeed.config=NAME",
    "models": "retrofit convert NAME ... / retrofit eval ppl NAME ... / model.name: NAME",
}
_ALIASES = {"recipes": "recipes", "convert": "convert specs", "specs": "convert specs", "datasets": "datasets",
            "deepspeed": "deepspeed", "models": "models", "aliases": "models"}


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("ls", help=help_text, description=help_text)
    p.add_argument("kind", nargs="?", choices=sorted(_ALIASES), help="list only this kind")
    p.add_argument("--json", action="store_true", help="print a JSON object {kind: [{name, description}]}")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from retrofit.catalog import bundled_dir, catalog

    found = catalog()
    if args.kind:
        found = {_ALIASES[args.kind]: found[_ALIASES[args.kind]]}
    if args.json:
        from retrofit.cli.common import print_json

        print_json({k: [{"name": n, "description": d} for n, d in v] for k, v in found.items()})
        return 0
    print(f"bundled in {bundled_dir()}")
    for kind, items in found.items():
        print(f"\n{kind}  ({_USE[kind]})")
        width = max((len(n) for n, _ in items), default=0)
        for name, desc in items:
            print(f"  {name:<{width}}  {desc}".rstrip())
        if not items:
            print("  (none)")
    return 0
