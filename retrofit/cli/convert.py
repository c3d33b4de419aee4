"""`retrofit convert`: model surgery from the command line.

    retrofit convert gemma3-270m --method macchiato --out out/g270-mac
    retrofit convert ./my-llama --method exp-linear --out out/llama-exp --dtype bfloat16
    retrofit convert gemma3-270m --config configs/convert-macchiato.yaml --window 256 --out out/g270-w256

Flags override the YAML (``--config``). Nothing is written unless everything succeeded (the
folder is built under a temporary name and renamed into place).
"""
from __future__ import annotations

import argparse
import sys

EPILOG = (
    "MODEL: a model folder, a hub id, a .gguf file or an alias (gemma3-270m, smollm2-135m; retrofit ls models). "
    "Method flags come from the method's config (retrofit/layers/<method>.py); a flag the chosen "
    "method does not have is an error. Defaults below are each method's."
)

class _Default(int):
    """An argparse default that stays recognisable (a flag given explicitly parses to a plain int)."""


DEFAULT_PROBE_TOKENS = _Default(256)

# flags of the common spec keys; the method keys' flags are derived from the registered configs
COMMON_FLAGS = {"method": "--method", "layers": "--layers", "dtype": "--dtype", "seed": "--seed",
                "rope_cap": "--rope-cap"}


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("convert", help=help_text, description=help_text, epilog=EPILOG)
    p.add_argument("model", metavar="MODEL", help="model folder, hub id, .gguf file or alias (gemma3-270m, smollm2-135m)")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--method", default=None, help="conversion method: macchiato | exp-linear | lavo | llp | any registered method")
    p.add_argument("--config", default=None, metavar="YAML", help="conversion recipe (configs/convert-*.yaml)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a method key as KEY=VALUE, repeatable (same as its flag; values parse as YAML)")
    p.add_argument("--layers", default=None, help="'all' (default), 'global' or layer indices like '0-5,8'")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: as stored)")
    p.add_argument("--seed", type=int, default=None, help="seed for the new weights' initialisation")
    p.add_argument("--rope-cap", type=int, default=None, metavar="TOKENS",
                   help="cap on the RoPE distance in the layers left as full attention: farther pairs are scored "
                        "at this distance (ReRoPE-style; default the base's max_position_embeddings - 1, so nothing "
                        "changes inside its context; 0 = no cap)")
    p.add_argument("--delta", action="store_true", help="save only the new weights + spec + base id")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint folder (never the input, the current directory or a folder "
                        "holding anything but a checkpoint)")
    p.add_argument("--probe-tokens", type=int, default=DEFAULT_PROBE_TOKENS, metavar="N",
                   help="tokens for the KL sanity probe (0 = skip; at most the model's positions: a longer N "
                        "is refused, the unset value shrinks to them)")
    p.add_argument("--rank-layers", action="store_true",
                   help="rank the candidate layers by KL(base || only that layer converted) on the probe text, "
                        "write OUT/layer_ranking.json and stop (no conversion saved)")
    p.add_argument("--keep-full", type=int, default=0, metavar="K",
                   help="rank the candidate layers (as --rank-layers) and keep the K most costly as full attention")
    p.add_argument("--rank-probe", choices=("text", "copy"), default="text",
                   help="what the ranking scores: text = the probe text (local modelling, default); copy = a "
                        "random stretch of tokens repeated once, farther back than the window (long-range "
                        "retrieval: the layers a passkey needs)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON summary on stdout (the progress lines go to stderr)")
    p.set_defaults(handler=_run)
    # The method flags need the method modules (torch): they are added when `convert` itself is
    # parsed, so `retrofit --help` and the other verbs stay instant.
    p.__class__ = type("ConvertParser", (_MethodFlagsParser, type(p)), {})


class _MethodFlagsParser(argparse.ArgumentParser):
    """Adds one flag per method config field (``--window``, ``--segment``, ...) before parsing.

    For ``--help`` alone the flags come from :mod:`retrofit.cli.method_flag_table` (the built-in
    methods' table, checked against the configs by the tests), so the help needs no torch import.
    """

    def parse_known_args(self, args=None, namespace=None):
        if not getattr(self, "_method_flags_added", False):
            self._method_flags_added = True
            given = list(sys.argv[1:] if args is None else args)
            if any(a in ("-h", "--help") for a in given):
                from retrofit.cli.method_flag_table import TABLE

                add_method_flags(self, TABLE)
            else:
                add_method_flags(self)
        return super().parse_known_args(args, namespace)


def method_flags(builtin_only: bool = False) -> dict[str, dict]:
    """``dest -> {flag, type, help, methods, defaults}`` over every registered method's config fields
    (``builtin_only``: the methods shipped in ``retrofit.layers``, not those registered at run time)."""
    from retrofit.layers.method import available_methods, get_method, method_fields

    from retrofit.surgery.spec import ConversionSpec

    flags: dict[str, dict] = {}
    # the default method's flags first (the order --help lists them in and errors name them in), then
    # the others' alphabetically: adding a method never reorders the default's
    names = sorted(available_methods(), key=lambda n: (n != ConversionSpec.DEFAULT_METHOD, n))
    if builtin_only:
        names = [n for n in names if get_method(n).config.__module__.startswith("retrofit.layers.")]
    for name in names:
        for f, tp in method_fields(get_method(name).config):
            entry = flags.setdefault(f.name, dict(flag="--" + f.name.replace("_", "-"), type=tp,
                                                  help=f.metadata.get("help", ""), methods=[], defaults=[]))
            entry["methods"].append(name)
            entry["defaults"].append(f"{name}: {f.default}")
    return flags


def _kind(tp) -> tuple[str, bool]:
    """``(kind, nullable)`` of a config field's type: kind int | float | str | bool | yaml."""
    import types
    import typing

    if tp is bool:
        return "bool", False
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    base = [a for a in args if a is not type(None)]
    if len(base) == 1 and base[0] in (int, float, str):
        return base[0].__name__, type(None) in args
    return "yaml", False


def method_flag_table(builtin_only: bool = True) -> dict[str, dict]:
    """``dest -> {flag, kind, nullable, help}`` of the built-in methods' flags (what --help shows;
    ``builtin_only=False``: every registered method's, a toy registered by a test included)."""
    table = {}
    for dest, e in method_flags(builtin_only).items():
        kind, nullable = _kind(e["type"])
        table[dest] = {"flag": e["flag"], "kind": kind, "nullable": nullable,
                       "help": f"{e['help']} [{', '.join(e['defaults'])}]"}
    return table


def _converter(kind_name: str, nullable: bool):
    if kind_name in ("int", "float", "str"):
        kind = {"int": int, "float": float, "str": str}[kind_name]

        def convert(text: str):
            if nullable and text.strip().lower() in ("none", "null"):
                return None
            return kind(text)

        convert.__name__ = kind.__name__  # argparse names the type in its error message
        return convert

    def any_value(text: str):  # Any: parsed as YAML, checked by the method's config
        try:
            return yaml_value(text, "the value")
        except Exception as exc:  # argparse reports it as one line naming the flag
            raise argparse.ArgumentTypeError(str(exc)) from None

    any_value.__name__ = "YAML"
    return any_value


def yaml_value(text: str, what: str):
    """``text`` parsed as one plain YAML value (no tags that build objects): SpecError otherwise."""
    import yaml

    from retrofit.errors import SpecError, parse_yaml

    try:
        return parse_yaml(text)
    except yaml.YAMLError as exc:
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise SpecError(f"{what}: {text!r} is not a plain YAML value ({problem}); give a number, a string, "
                        "a list or a mapping") from None


def add_method_flags(p: argparse.ArgumentParser, table: dict[str, dict] | None = None) -> None:
    """One flag per method key of ``table`` (default: :func:`method_flag_table`, which imports the methods)."""
    for dest, e in (method_flag_table(builtin_only=False) if table is None else table).items():
        if e["flag"] in p._option_string_actions:
            continue
        text = e["help"].replace("%", "%%")
        if e["kind"] == "bool":
            p.add_argument(e["flag"], dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            conv = _converter(e["kind"], e["nullable"])
            p.add_argument(e["flag"], dest=dest, type=conv, default=None, help=text,
                           metavar="N" if conv.__name__ in ("int", "float") else "VALUE")


def _given_method_keys(args: argparse.Namespace) -> dict:
    """The method keys given as flags (``--window 8``) or ``--option KEY=VALUE``."""
    from retrofit.errors import SpecError

    flags = method_flags()
    keys = {dest: getattr(args, dest) for dest in flags if getattr(args, dest, None) is not None}
    given = {key: f"{flags[key]['flag']} {value!r}" for key, value in keys.items()}
    for item in getattr(args, "option", []) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--option expects KEY=VALUE, got {item!r}")
        key, value = key.strip(), yaml_value(value, f"--option {key.strip()}")
        if key in keys and keys[key] != value:  # the last one won silently
            raise SpecError(f"{given[key]} and --option {key}={value!r} disagree; give the value once")
        keys[key], given[key] = value, f"--option {key}={value!r}"
    return keys


def build_spec(args: argparse.Namespace):
    """ConversionSpec from ``--config`` (optional) and the flags (flags win)."""
    from retrofit.surgery import ConversionSpec

    keys = _given_method_keys(args)
    common = dict(method=args.method, layers=args.layers, dtype=args.dtype, seed=args.seed, rope_cap=args.rope_cap)
    if args.config:
        method = args.method or _recipe_method(args.config)
        _check_flags_apply(method, keys)
        return ConversionSpec.from_yaml(args.config, **common, **keys)
    _check_flags_apply(args.method or ConversionSpec.DEFAULT_METHOD, keys)
    return ConversionSpec(**{k: v for k, v in common.items() if v is not None}, **keys)


def _recipe_method(path) -> str | None:
    from retrofit.surgery import ConversionSpec

    try:
        import yaml
        from pathlib import Path

        data = yaml.safe_load(Path(path).read_text()) or {}
    except Exception:  # from_yaml reports a missing or broken file with its own message
        return None
    if isinstance(data, dict) and isinstance(data.get("convert"), dict):
        data = data["convert"]
    return data.get("method", ConversionSpec.DEFAULT_METHOD) if isinstance(data, dict) else None


def _check_flags_apply(method: str | None, keys: dict) -> None:
    """A method flag the chosen method does not have is an error, not silently ignored."""
    from retrofit.errors import SpecError
    from retrofit.layers.method import get_method

    if not method or not isinstance(method, str):
        return  # the spec reports a missing / bad method
    own = get_method(method).config.field_names()  # SpecError for an unknown method
    flags = method_flags()
    bad = [k for k in keys if k not in own]
    if not bad:
        return
    def name(k):
        return flags[k]["flag"] if k in flags else f"--option {k}"
    unknown = [k for k in bad if k not in flags]
    if unknown:
        raise SpecError(f"method {method!r} has no key(s) {', '.join(sorted(unknown))}; its keys: "
                        f"{', '.join(own) or 'none'}")
    used = ", ".join(flags[k]["flag"] for k in own if k in flags) or "none"
    raise SpecError(f"{', '.join(name(k) for k in bad)} do(es) not apply to method {method!r} (its flags: {used}); "
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

    from retrofit.errors import SpecError
    from retrofit.fs import check_replaceable, output_lock

    spec = build_spec(args)  # bad specs fail before any model is loaded
    args.probe_tokens_given = not isinstance(args.probe_tokens, _Default)
    if args.probe_tokens < 0:
        raise SpecError(f"--probe-tokens must be >= 0 (0 skips the KL probe), got {args.probe_tokens}")
    if args.rank_layers and args.keep_full:  # the one stops after ranking, the other converts: not both at once
        raise SpecError(f"--rank-layers and --keep-full {args.keep_full} contradict each other: --rank-layers only "
                        "writes OUT/layer_ranking.json and saves no conversion, --keep-full ranks the layers and "
                        "saves a conversion; pass one of them")
    if args.probe_tokens == 0 and (args.rank_layers or args.keep_full):
        flag = "--rank-layers" if args.rank_layers else "--keep-full"
        raise SpecError(f"{flag} scores the layers on the probe text: --probe-tokens 0 leaves none; pass "
                        "--probe-tokens 64 or more (e.g. the default 256)")
    _precheck_layers(args.model, spec)
    out = Path(args.out)
    check_replaceable(out, overwrite=args.overwrite, protect=[args.model])
    with output_lock(out):  # a second convert into the same --out fails now, not after the work
        check_replaceable(out, overwrite=args.overwrite, protect=[args.model])  # a killed swap may be settled now
        return _convert(args, spec, out)


def _convert(args: argparse.Namespace, spec, out) -> int:
    import functools
    import sys
    import time

    say = functools.partial(print, file=sys.stderr) if args.json else print
    if args.quiet:  # -q: only warnings and errors
        say = lambda *a, **k: None  # noqa: E731
    summary: dict = {"model": args.model, "out": str(args.out)}

    from retrofit.patches import get_patch
    from retrofit.surgery import (
        convert, converted_layers, load_any, new_parameter_names, save, save_delta,
    )
    from retrofit.surgery import probe as P
    from retrofit.surgery.rope_cap import capped_layers

    def warn(text: str) -> None:  # a warning prints under -q too
        print(f"retrofit convert: warning: {text}", file=sys.stderr)

    t0 = time.perf_counter()
    model, tokenizer = load_any(args.model, dtype=spec.dtype)
    t_load = time.perf_counter() - t0
    patch = get_patch(model)  # unsupported families fail here, before any work
    spec.validate_for(model.config)
    _check_probe_positions(args, model.config)  # before the probe's minutes, not after
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

    shown = spec.resolved(model.config)  # the values the checkpoint records (window=None -> its default)
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
    say(f"converted {len(layers)}/{model.config.num_hidden_layers} layers to {shown.describe()} [{t_conv:.1f}s]")
    say(f"new weights: {len(new)} tensors, {n_new / 1e6:.3f}M params (trainable); pretrained weights frozen")
    caps = capped_layers(model)
    summary.update(rope_capped_layers=sorted(caps))
    if not caps and args.rope_cap:  # spec.rope_cap from --rope-cap alone: a --config cap is the recipe's choice
        warn(f"--rope-cap {args.rope_cap} has no effect: no layer is left as full attention "
             "(every attention layer was converted); drop the flag")
    if caps:
        kept = ", ".join(map(str, caps))
        cap = model.config.retrofit["rope_cap"]
        say(f"layers {kept} stay full attention with RoPE distances capped at {cap} tokens "
            "(--rope-cap; farther pairs are scored at the cap)")

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


def _check_probe_positions(args: argparse.Namespace, config) -> None:
    """A probe longer than the model's positions would run for minutes on positions it never saw: the
    default probe shrinks to the model's positions, a longer ``--probe-tokens`` is refused."""
    from retrofit.errors import SpecError

    max_pos = getattr(config, "max_position_embeddings", None)
    if not getattr(args, "probe_tokens_given", True) and max_pos:
        args.probe_tokens = min(args.probe_tokens, int(max_pos))
    probe = args.probe_tokens if args.probe_tokens > 0 else 0
    if args.rank_layers or args.keep_full:
        probe = max(probe, 64)
    if probe and max_pos and probe > int(max_pos):
        raise SpecError(f"--probe-tokens {args.probe_tokens} exceeds the model's max_position_embeddings={max_pos}: "
                        f"pass --probe-tokens {max_pos} or less (0 skips the KL probe)")


def _ranked_spec(args: argparse.Namespace, spec, model, tokenizer, out):
    """Rank the spec's layers (KL of converting each alone); the spec without the K costliest, or None."""
    import dataclasses
    import time

    from retrofit.errors import SpecError
    from retrofit.surgery import probe as P

    if args.keep_full < 0:
        raise SpecError(f"--keep-full must be >= 0, got {args.keep_full}")
    t0 = time.perf_counter()
    candidates = spec.layer_indices(model.config)
    if args.keep_full >= len(candidates):
        raise SpecError(f"--keep-full {args.keep_full} keeps every one of the {len(candidates)} candidate layers")
    last = None
    if args.rank_probe == "copy":
        window = getattr(spec.resolved(model.config).config, "window", None) or 0
        span = max(args.probe_tokens, window + 64)  # the first copy lies beyond the window
        ids, last = P.copy_probe_ids(tokenizer, span, model.config.vocab_size, seed=spec.seed or 0)
        what = f"the second copy of {span} random tokens ({span - 1} positions back; window {window or 'none'})"
    else:
        ids = P.probe_ids(tokenizer, max(args.probe_tokens, 64), model.config.vocab_size, seed=spec.seed)
        what = f"{ids.shape[1]} probe tokens"
    ranking = P.rank_layers(model, spec, ids, last)
    show = print
    if args.quiet and not args.rank_layers:  # -q: the ranking is a step of the conversion, not its result
        show = lambda *a, **k: None  # noqa: E731
    show(f"layer ranking on {what}, KL(base || only that layer converted), most costly first "
         f"[{time.perf_counter() - t0:.1f}s]:")
    for r in ranking:
        show(f"  layer {r['layer']:>3}  KL {r['kl']:.4f}")
    if args.rank_layers and not args.keep_full:
        from retrofit.fs.atomic import write_json_atomic

        write_json_atomic(out / "layer_ranking.json", {
            "spec": spec.to_dict(), "probe": args.rank_probe, "probe_tokens": int(ids.shape[1]),
            "scored_positions": int(last or ids.shape[1]), "ranking": ranking}, indent=1, default=None)
        show(f"wrote {out / 'layer_ranking.json'}")
        return None
    keep = {r["layer"] for r in ranking[: args.keep_full]}
    show(f"keeping layers {sorted(keep)} as full attention")
    return dataclasses.replace(spec, layers=[i for i in candidates if i not in keep])
