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
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint folder (never the input, the current directory or a folder "
                        "holding anything but a checkpoint)")
    p.add_argument("--probe-tokens", type=int, default=256, help="tokens for the KL sanity probe (0 = skip)")
    p.add_argument("--sinks", type=int, default=None, help="attention sinks: the window also sees the first n tokens")
    p.add_argument("--rank-layers", action="store_true",
                   help="rank the candidate layers by KL(base || only that layer converted) on the probe text, "
                        "write OUT/layer_ranking.json and stop (no conversion saved)")
    p.add_argument("--keep-full", type=int, default=0, metavar="K",
                   help="rank the candidate layers (as --rank-layers) and keep the K most costly as full attention")
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
        sinks=getattr(args, "sinks", None),
    )
    if args.config:
        spec = ConversionSpec.from_yaml(args.config, **flags)
        if options:
            spec = ConversionSpec.from_dict({**spec.to_dict(), "options": {**spec.options, **options}})
    else:
        given = {k: v for k, v in flags.items() if v is not None}
        spec = ConversionSpec(**given, options=options) if options else ConversionSpec(**given)
    _check_flags_apply(args, spec)
    return spec


_METHOD_FLAGS = {"window": "--window", "latents": "--latents", "init_swa_share": "--init-swa-share",
                 "conv_size": "--conv-size"}


def _check_flags_apply(args: argparse.Namespace, spec) -> None:
    """A flag the chosen method does not use is an error, not silently ignored."""
    from retrofit.errors import SpecError
    from retrofit.surgery.methods import get_method

    uses = set(get_method(spec.method).uses)
    ignored = [flag for key, flag in _METHOD_FLAGS.items() if getattr(args, key, None) is not None and key not in uses]
    if ignored:
        used = ", ".join(f for k, f in _METHOD_FLAGS.items() if k in uses) or "none of them"
        raise SpecError(f"{', '.join(ignored)} do(es) not apply to method {spec.method!r} (it uses {used}); "
                        "drop the flag or choose another --method")


def _precheck_layers(model: str, spec) -> None:
    """For a local model folder, check the layer selection against config.json before loading weights."""
    import json
    from pathlib import Path

    cfg = Path(model).expanduser() / "config.json"
    if not isinstance(spec.layers, list) or not cfg.is_file():
        return
    try:
        raw = json.loads(cfg.read_text())
        n_layers = int((raw.get("text_config") or raw)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # load_any reports a broken config with its own message
    from retrofit.errors import SpecError

    bad = [i for i in spec.layers if i >= n_layers]
    if bad:
        raise SpecError(f"layers {bad[:8]}{' ...' if len(bad) > 8 else ''} do not exist: {model} has {n_layers} "
                        f"layers (0..{n_layers - 1})")


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from retrofit.fs import check_replaceable, output_lock

    spec = build_spec(args)  # bad specs fail before any model is loaded
    _precheck_layers(args.model, spec)
    out = Path(args.out)
    check_replaceable(out, overwrite=args.overwrite, protect=[args.model])
    with output_lock(out):  # a second convert into the same --out fails now, not after the work
        return _convert(args, spec, out)


def _convert(args: argparse.Namespace, spec, out) -> int:
    import functools
    import sys
    import time

    say = functools.partial(print, file=sys.stderr) if args.json else print
    summary: dict = {"model": args.model, "out": str(args.out)}

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

    if args.rank_layers or args.keep_full:
        spec = _ranked_spec(args, spec, model, tokenizer, out)
        if spec is None:
            return 0
        model, tokenizer = load_any(args.model, dtype=spec.dtype)  # ranking converted the candidates

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
        save_delta(model, out, overwrite=args.overwrite)  # refuses an --out that is or contains its base
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


def _ranked_spec(args: argparse.Namespace, spec, model, tokenizer, out):
    """Rank the spec's layers (KL of converting each alone); the spec without the K costliest, or None."""
    import dataclasses
    import json
    import time

    from retrofit.errors import SpecError
    from retrofit.surgery import probe as P

    if args.keep_full < 0:
        raise SpecError(f"--keep-full must be >= 0, got {args.keep_full}")
    t0 = time.perf_counter()
    ids = P.probe_ids(tokenizer, max(args.probe_tokens, 64), model.config.vocab_size, seed=spec.seed)
    candidates = spec.layer_indices(model.config)
    if args.keep_full >= len(candidates):
        raise SpecError(f"--keep-full {args.keep_full} keeps every one of the {len(candidates)} candidate layers")
    ranking = P.rank_layers(model, spec, ids)
    print(f"layer ranking on {ids.shape[1]} probe tokens, KL(base || only that layer converted), most costly first "
          f"[{time.perf_counter() - t0:.1f}s]:")
    for r in ranking:
        print(f"  layer {r['layer']:>3}  KL {r['kl']:.4f}")
    if args.rank_layers and not args.keep_full:
        out.mkdir(parents=True, exist_ok=True)
        (out / "layer_ranking.json").write_text(json.dumps({"spec": spec.to_dict(), "probe_tokens": int(ids.shape[1]),
                                                            "ranking": ranking}, indent=1) + "\n")
        print(f"wrote {out / 'layer_ranking.json'}")
        return None
    keep = {r["layer"] for r in ranking[: args.keep_full]}
    print(f"keeping layers {sorted(keep)} as full attention")
    return dataclasses.replace(spec, layers=[i for i in candidates if i not in keep])
