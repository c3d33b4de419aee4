"""`retrofit convert`: model surgery from the command line.

    retrofit convert gemma3-270m --method macchiato --out out/g270-mac
    retrofit convert ./my-llama --method exp-linear --out out/llama-exp --dtype bfloat16
    retrofit convert gemma3-270m --config configs/convert-macchiato.yaml --window 256 --out out/g270-w256

Flags override the YAML (``--config``). Nothing is written unless everything succeeded (the
folder is built under a temporary name and renamed into place).
"""
from __future__ import annotations

import argparse

EPILOG = (
    "MODEL: a model folder, a hub id, a .gguf file or the alias gemma3-270m. "
    "Defaults: window 128, latents 128 (total over query heads), init-swa-share from "
    "retrofit.surgery.DEFAULT_INIT_SWA_SHARE, no conv, all layers."
)


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("convert", help=help_text, description=help_text, epilog=EPILOG)
    p.add_argument("model", metavar="MODEL", help="model folder, hub id, .gguf file or alias (gemma3-270m)")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--method", default=None, help="conversion method: macchiato | exp-linear | any registered method")
    p.add_argument("--config", default=None, metavar="YAML", help="conversion recipe (configs/convert-*.yaml)")
    p.add_argument("--window", type=int, default=None, help="sliding window w in tokens (macchiato)")
    p.add_argument("--latents", type=int, default=None, help="latent states L in total, split over query heads")
    p.add_argument("--init-swa-share", type=float, default=None, help="initial p(0|t) in (0, 1] (macchiato)")
    p.add_argument("--conv-size", type=int, default=None, help="causal conv size before the latent projections (0 = none)")
    p.add_argument("--segment", type=int, default=None, help="LLP segment s in tokens (half-segments of s/2)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method-specific option, repeatable (e.g. --option bases=32 for lavo); values parse as YAML")
    p.add_argument("--layers", default=None, help="'all' (default) or layer indices like '0-5,8'")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: as stored)")
    p.add_argument("--seed", type=int, default=None, help="seed for the new weights' initialisation")
    p.add_argument("--delta", action="store_true", help="save only the new weights + spec + base id")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--probe-tokens", type=int, default=256, help="tokens for the KL sanity probe (0 = skip)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON summary on stdout (the progress lines go to stderr)")
    p.set_defaults(handler=_run)


def build_spec(args: argparse.Namespace):
    """ConversionSpec from ``--config`` (optional) and the flags (flags win)."""
    import yaml

    from retrofit.surgery import ConversionSpec

    from retrofit.errors import SpecError

    options = {}
    for item in getattr(args, "option", []) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--option expects KEY=VALUE, got {item!r}")
        options[key.strip()] = yaml.safe_load(value)
    if getattr(args, "segment", None) is not None:
        options["segment"] = args.segment
    flags = dict(
        method=args.method, window=args.window, latents=args.latents, init_swa_share=args.init_swa_share,
        conv_size=args.conv_size, layers=args.layers, dtype=args.dtype, seed=args.seed,
    )
    if args.config:
        spec = ConversionSpec.from_yaml(args.config, **flags)
        if options:
            spec = ConversionSpec.from_dict({**spec.to_dict(), "options": {**spec.options, **options}})
        return spec
    flags = {k: v for k, v in flags.items() if v is not None}
    return ConversionSpec(**flags, options=options) if options else ConversionSpec(**flags)


def _run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    import functools
    import sys

    from retrofit.errors import CheckpointError

    say = functools.partial(print, file=sys.stderr) if args.json else print
    summary: dict = {"model": args.model, "out": str(args.out)}

    spec = build_spec(args)  # bad specs fail before any model is loaded
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise CheckpointError(f"{out} already exists; choose another --out or pass --overwrite")

    from retrofit.patches import get_patch
    from retrofit.surgery import (
        convert, converted_layers, load_any, new_parameter_names, save, save_delta,
    )
    from retrofit.surgery import probe as P

    t0 = time.perf_counter()
    model, tokenizer = load_any(args.model, dtype=spec.dtype)
    t_load = time.perf_counter() - t0
    patch = get_patch(model)  # unsupported families fail here, before any work
    spec.validate_for(model.config)
    summary.update(family=patch.family, num_layers=model.config.num_hidden_layers,
                   parameters=sum(p.numel() for p in model.parameters()), load_seconds=round(t_load, 3))
    say(f"loaded {args.model}: {type(model).__name__} ({patch.family}), "
          f"{model.config.num_hidden_layers} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{next(model.parameters()).dtype} [{t_load:.1f}s]")

    ids = base_lp = None
    if args.probe_tokens > 0:
        ids = P.probe_ids(tokenizer, args.probe_tokens, model.config.vocab_size, seed=spec.seed)
        base_lp = P.log_probs(model, ids)

    t0 = time.perf_counter()
    convert(model, spec)
    t_conv = time.perf_counter() - t0
    new = new_parameter_names(model)
    params = dict(model.named_parameters())
    n_new = sum(params[n].numel() for n in new)
    layers = converted_layers(model)
    summary.update(retrofit=dict(model.config.retrofit), model_type=model.config.model_type,
                   converted_layers=layers, new_tensors=len(new), new_parameters=n_new,
                   convert_seconds=round(t_conv, 3))
    say(f"converted {len(layers)}/{model.config.num_hidden_layers} layers to {spec.describe()} [{t_conv:.1f}s]")
    say(f"new weights: {len(new)} tensors, {n_new / 1e6:.3f}M params (trainable); pretrained weights frozen")

    if ids is not None:
        t0 = time.perf_counter()
        conv_lp = P.log_probs(model, ids)
        probe = summary["probe"] = {"tokens": int(ids.shape[1]), "kl_base_converted": P.kl_divergence(base_lp, conv_lp)}
        msg = f"KL probe on {ids.shape[1]} tokens: KL(base || converted) = {probe['kl_base_converted']:.4f}"
        with P.closed_latent_path(model) as closed:
            if closed:
                anchor_lp = P.log_probs(model, ids)
        if closed:
            probe.update(kl_anchor_converted=P.kl_divergence(anchor_lp, conv_lp),
                         kl_base_anchor=P.kl_divergence(base_lp, anchor_lp))
            msg += (f", KL(SWA anchor || converted) = {P.kl_divergence(anchor_lp, conv_lp):.4f}"
                    f", KL(base || SWA anchor) = {P.kl_divergence(base_lp, anchor_lp):.4f}")
        say(f"{msg} [{time.perf_counter() - t0:.1f}s]")
        del base_lp, conv_lp

    t0 = time.perf_counter()
    if args.delta:
        save_delta(model, out, overwrite=args.overwrite)
        kind = "delta (new weights + spec + base id)"
    else:
        save(model, out, tokenizer=tokenizer, overwrite=args.overwrite)
        kind = "checkpoint (safetensors + config.json with a retrofit section" + (" + tokenizer)" if tokenizer else ")")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    say(f"saved {kind} to {out} ({size / 2**20:.1f} MiB) [{time.perf_counter() - t0:.1f}s]")
    say(f"next: retrofit train ... or retrofit generate {out} --prompt '...'")
    if args.json:
        from retrofit.cli.common import print_json

        summary.update(kind="delta" if args.delta else "checkpoint", size_bytes=size)
        print_json(summary)
    return 0
