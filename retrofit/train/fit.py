"""Fit a converted model's linear read to its base's attention, layer by layer (``retrofit fit``).

LoLCATs' first stage trains feature maps so that a linear attention's weights match the softmax's.
Here every converted layer is fitted on its own, on the inputs the base gives it (each layer's
hidden states captured once per sequence with every layer running its pretrained attention), with
no step through the network, so a CPU spends its time on the fit itself:

1. ``fit.maps``: per layer, Adam on the Hedgehog feature maps against KL(the base's weights over
   the keys beyond the window || the read's kernel weights over them)
   (:meth:`~retrofit.layers.hedgehog.HedgehogAttention.read_kl`).
2. ``fit.scale``: per layer and head, the share's scale ``c(q, n) = a.q + b + g log n`` by least
   squares against the base's log mass beyond the window
   (:meth:`~retrofit.layers.hedgehog.HedgehogAttention.scale_regression`). Its sequences may be
   longer than the base's context: the teacher is then the base with its RoPE distances capped
   (``teacher_rope_cap``, the conversion's ``rope_cap``), the strongest zero-shot form of the base
   there, and the read's key count reaches the lengths it will be used at.

Sequences come from the recipe's data section (``data.recall`` writes long-range repeats in, so the
softmax reaches back past the window); each part takes its own length and count. The result is a
delta checkpoint (the new weights) with the fit's report (``fit.json``) beside them.
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from retrofit.errors import SpecError
from retrofit.surgery.distill import converted_modules, distill_mode
from retrofit.train.recipe import Recipe

__all__ = ["FIT", "FitReport", "LayerInputs", "capture_layer_inputs", "check_fittable_recipe", "fit_maps", "fit_read",
           "fit_scale", "fit_sequences", "fittable_layers", "fittable_methods", "report_json", "run_fit", "save_fitted",
           "scale_problem"]

FIT = "fit"  # the capability a method declares (MethodConfig.capabilities) for its layers to be fitted here

LayerInputs = list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]  # per sequence: hidden, (cos, sin)


@dataclass
class FitReport:
    """What :func:`fit_read` did: per part, its sequences, tokens and minutes, and per layer its numbers."""

    maps: dict = field(default_factory=dict)
    scale: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line: each part's sequences, tokens and minutes, and the means over layers of its numbers."""
        parts = []
        for name, part, key in (("maps", self.maps, "kl"), ("scale", self.scale, "rms")):
            layers = part.get("layers") or []
            if not layers:
                continue
            before = sum(r[f"{key}_before"] for r in layers) / len(layers)
            after = sum(r[f"{key}_after"] for r in layers) / len(layers)
            what = "KL beyond the window" if key == "kl" else "scale rms error"
            parts.append(f"{name}: {part['sequences']} x {part['seq_len']:,} tokens in {part['minutes']:.1f} min, "
                         f"{what} {before:.3f} -> {after:.3f} nats (mean of {len(layers)} layers)")
        return "; ".join(parts) or "nothing fitted"

    def table(self) -> str:
        """A human table: per layer the maps' KL before / after and the scale's residual before / after."""
        rows = {}
        for r in self.maps.get("layers", []):
            rows.setdefault(r["layer"], {}).update(kl=f"{r['kl_before']:.3f} -> {r['kl_after']:.3f}")
        for r in self.scale.get("layers", []):
            rows.setdefault(r["layer"], {}).update(
                rms=f"{r['rms_before']:.3f} -> {r['rms_after']:.3f}", bias=f"{r['bias']:.2f}",
                count=f"{r['count_weight']:.2f}")
        lines = ["| layer | maps: KL beyond the window (nats) | scale: rms error (nats) | bias (mean) | count weight (mean) |",
                 "|---:|---:|---:|---:|---:|"]
        for layer in sorted(rows):
            r = rows[layer]
            lines.append(f"| {layer} | {r.get('kl', '-')} | {r.get('rms', '-')} | {r.get('bias', '-')} | {r.get('count', '-')} |")
        return "\n".join(lines)


def fittable_methods() -> list[str]:
    """The registered methods whose config declares the ``fit`` capability, sorted."""
    from retrofit.layers.method import available_methods, get_method

    return sorted(name for name in available_methods() if FIT in get_method(name).config.capabilities)


def _declares_fit(method: str | None) -> bool:
    from retrofit.layers.method import registered_method

    info = registered_method(method) if method else None
    return info is not None and FIT in info.config.capabilities


def _not_fittable(methods: list[str], where: str) -> SpecError:
    fittable = fittable_methods()
    can = f"method{'s' if len(fittable) > 1 else ''} {', '.join(fittable)}" if fittable else "none is registered"
    return SpecError(f"retrofit fit fits the methods whose config declares the {FIT!r} capability ({can}); {where} "
                     f"method {', '.join(methods)}, which does not: train it with retrofit train instead")


def check_fittable_recipe(recipe: Recipe) -> None:
    """Refuse, before any weight loads, a recipe whose conversion section will convert its base
    (``model.name`` names an unconverted model) with a method that does not declare ``fit``. A
    converted ``model.name`` is checked when it is loaded (:func:`fittable_layers`)."""
    from retrofit.surgery.loading import names_converted
    from retrofit.surgery.spec import ConversionSpec

    conversion = recipe.conversion if isinstance(recipe.conversion, dict) else {}
    if not conversion or names_converted(recipe.model.name) is not False:
        return
    method = conversion.get("method") or ConversionSpec.DEFAULT_METHOD
    if not _declares_fit(method):
        raise _not_fittable([str(method)], "the recipe's conversion section converts with")


def fittable_layers(model: nn.Module) -> list[nn.Module]:
    """The converted layers, all of methods that declare the ``fit`` capability; a SpecError otherwise."""
    layers = converted_modules(model)
    if not layers:
        names = " or ".join(fittable_methods()) or "one that declares fit"
        raise SpecError(f"the model has no converted layers: set a conversion section (method: {names}) in the "
                        "recipe or point model.name at such a conversion")
    other = sorted({m.method for m in layers if not _declares_fit(m.method)})
    if other:
        raise _not_fittable(other, "the model's layers are of")
    return layers


def fit_sequences(recipe: Recipe, tokenizer: Any, seq_len: int, count: int, recall_facts: int | None) -> list[torch.Tensor]:
    """The first ``count`` ``(seq_len,)`` sequences of the recipe's training stream at ``seq_len``
    tokens (``data.recall`` with ``recall_facts`` facts each when given)."""
    from retrofit.train.data import data_files, train_stream

    part = copy.deepcopy(recipe)
    part.data.seq_len = int(seq_len)
    if recall_facts is not None:
        part.data.recall.facts = int(recall_facts)
    stream, _ = train_stream(part, tokenizer, data_files(part), 0, 1)
    packed = getattr(stream, "packed", stream)
    packed.repeat = False  # one pass: no sequence twice
    out = []
    for item in stream:
        out.append(item[0] if isinstance(item, tuple) else item)
        if len(out) == count:
            break
    if len(out) < count:
        raise SpecError(f"the data gives only {len(out)} sequences of {seq_len} tokens, {count} asked for: add text "
                        "or ask for fewer / shorter sequences")
    return out


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, tuple]]:
    """``{layer index: (hidden_states (1, T, C), (cos, sin))}``: what each converted layer receives
    when every converted layer runs its pretrained attention (the base, RoPE-capped past
    ``teacher_rope_cap``) on ``ids (T,)``."""
    found, layers = {}, converted_modules(model)

    def recording(module: nn.Module) -> Callable:
        pretrained = module.original_attention  # the teacher's path calls it with the layer's own inputs

        def original_attention(hidden_states, position_embeddings, attention_mask=None):
            found[int(module.layer_idx)] = (hidden_states.detach(), tuple(t.detach() for t in position_embeddings))
            return pretrained(hidden_states, position_embeddings, attention_mask)
        return original_attention

    for m in layers:  # an instance attribute for the block (a distilling layer's call skips module hooks)
        m.original_attention = recording(m)
    try:
        with distill_mode(model, "teacher"):
            model(input_ids=ids[None].to(next(model.parameters()).device), use_cache=False, logits_to_keep=1)
    finally:
        for m in layers:
            del m.original_attention
    return found


def _first_row(attn: nn.Module, T: int) -> int:
    """The first query row of a ``T``-token sequence with a key beyond the window (and its sinks)."""
    return min(attn.window + attn.sinks, T - 1)


def _rows(attn: nn.Module, T: int, count: int, g: torch.Generator) -> torch.Tensor:
    """``count`` random query rows with keys beyond the window (and its sinks), sorted, distinct."""
    return torch.randint(_first_row(attn, T), T, (count,), generator=g).unique()


def _qkv(attn: nn.Module, inputs: LayerInputs) -> list[tuple]:
    with torch.no_grad():
        return [attn.patch.project_qkv(attn, h, pe) for h, pe in inputs]


def _mean_kl(attn: nn.Module, inputs: LayerInputs, qkv: list, rows: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return float(torch.stack([attn.read_kl(h, pe, None, r, x).mean() for (h, pe), x, r in zip(inputs, qkv, rows)]).mean())


def fit_maps(attn: nn.Module, inputs: LayerInputs, *, steps: int, queries: int, lr: float,
             generator: torch.Generator, on_step: Callable[[float], None] | None = None) -> dict:
    """Adam on ``attn``'s feature maps for ``steps`` steps, each on ``queries`` random rows of one
    random sequence of ``inputs``; returns the KL (nats per row, mean over heads) on fixed rows of
    every sequence before and after. ``on_step(kl)`` is called after each step with its rows' mean KL."""
    qkv = _qkv(attn, inputs)
    fixed = [torch.linspace(_first_row(attn, h.shape[1]), h.shape[1] - 1, queries).round().long().unique()
             for h, _ in inputs]
    before = _mean_kl(attn, inputs, qkv, fixed)
    params = [attn.feature_query.weight, attn.feature_key.weight]
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        n = int(torch.randint(len(inputs), (1,), generator=generator))
        h, pe = inputs[n]
        kl = attn.read_kl(h, pe, None, _rows(attn, h.shape[1], queries, generator), qkv[n])
        opt.zero_grad(set_to_none=True)
        kl.sum().backward(inputs=params)
        opt.step()
        if on_step is not None:
            on_step(float(kl.detach().mean()))
    return {"kl_before": before, "kl_after": _mean_kl(attn, inputs, qkv, fixed)}


@torch.no_grad()
def scale_problem(attn: nn.Module, inputs: LayerInputs, *, queries: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares problem of ``attn``'s share scale on ``queries`` random rows of every
    sequence of ``inputs``: ``x (Hq, N, d + 2)`` and ``y (Hq, N)`` fp64 over the ``N`` rows with keys
    beyond the window (:meth:`~retrofit.layers.hedgehog.HedgehogAttention.scale_regression`)."""
    xs, ys = [], []
    for (h, pe), x in zip(inputs, _qkv(attn, inputs)):
        inp, target, ok = attn.scale_regression(h, pe, None, _rows(attn, h.shape[1], queries, generator), x)
        xs.append(inp[0][:, ok[0]])
        ys.append(target[0][:, ok[0]])
    return torch.cat(xs, dim=1).double(), torch.cat(ys, dim=1).double()


@torch.no_grad()
def fit_scale(attn: nn.Module, inputs: LayerInputs, *, queries: int, generator: torch.Generator) -> dict:
    """Solve :func:`scale_problem` and set the solution into the layer; returns the rms error (nats,
    mean over heads) before and after and the fitted bias and count weight (means over heads)."""
    x, y = scale_problem(attn, inputs, queries=queries, generator=generator)
    if x.shape[1] < x.shape[2]:
        raise SpecError(f"layer {attn.layer_idx}: {x.shape[1]} rows with keys beyond the window for {x.shape[2]} "
                        "coefficients a head: use longer sequences (fit.scale.seq_len) or more (sequences, queries)")
    s = attn.memory_scale
    old = torch.cat([s.weight, s.bias[:, None], s.count_weight[:, None]], dim=1).double()
    coef = torch.linalg.lstsq(x, y[..., None]).solution[..., 0]  # (H, d + 2)
    attn.set_memory_scale(coef.to(s.weight.dtype))

    def rms(c: torch.Tensor) -> float:
        return float(((x @ c[..., None])[..., 0] - y).pow(2).mean(-1).sqrt().mean())

    return {"rms_before": rms(old), "rms_after": rms(coef), "bias": float(coef[:, -2].mean()),
            "count_weight": float(coef[:, -1].mean()), "rows": int(x.shape[1])}


def _bar(total: int, desc: str, unit: str, enabled: bool):
    """A progress bar on stderr (elapsed and remaining time), as ``retrofit train`` and ``eval`` show."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False, disable=not enabled)


def _capture(model: nn.Module, sequences: list[torch.Tensor], label: str, progress: bool) -> list[dict]:
    with _bar(len(sequences), f"fit {label}: capture", "seq", progress) as bar:
        captured = []
        for ids in sequences:
            captured.append(capture_layer_inputs(model, ids))
            bar.update(1)
    return captured


PerLayer = Callable[[nn.Module, LayerInputs, Callable[[float], None]], dict]


def _part(model: nn.Module, layers: list[nn.Module], sequences: list[torch.Tensor], per_layer: PerLayer,
          label: str, log: Callable[[str], None], *, steps: int = 0, progress: bool = True) -> dict:
    """Capture every layer's inputs on ``sequences``, then ``per_layer`` each layer; the part's record.
    ``per_layer(attn, inputs, on_step)`` calls ``on_step(loss)`` after each of its ``steps`` steps
    (none: the layer is one unit of the progress bar, which shows layer i/N, steps, loss and elapsed time)."""
    start = time.time()
    captured = _capture(model, sequences, label, progress)
    log(f"[retrofit] fit {label}: captured {len(layers)} layers' inputs on {len(sequences)} x {len(sequences[0]):,} "
        f"tokens ({time.time() - start:.0f} s)")
    rows = _fit_layers(layers, captured, per_layer, label, log, steps=steps, progress=progress, start=start)
    return {"sequences": len(sequences), "seq_len": len(sequences[0]), "tokens": sum(len(s) for s in sequences),
            "minutes": round((time.time() - start) / 60, 2), "layers": rows}


def _fit_layers(layers: list[nn.Module], captured: list[dict], per_layer: PerLayer, label: str,
                log: Callable[[str], None], *, steps: int, progress: bool, start: float) -> list[dict]:
    """``per_layer`` on each layer under one progress bar; a log line (above the bar) after each layer."""
    from tqdm.auto import tqdm

    rows = []
    with _bar(len(layers) * max(steps, 1), f"fit {label}", "step" if steps else "layer", progress) as bar:
        for i, attn in enumerate(layers, start=1):
            li, where = int(attn.layer_idx), f"layer {i}/{len(layers)}"
            bar.set_postfix_str(where)

            def on_step(loss: float, where: str = where) -> None:
                bar.set_postfix_str(f"{where} loss {loss:.3f}", refresh=False)
                bar.update(1)

            record = {"layer": li, **per_layer(attn, [c[li] for c in captured], on_step)}
            if not steps:
                bar.update(1)
            bar.refresh()  # the layer's last step and loss, however fast its steps were
            rows.append(record)
            shown = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items() if k != "layer")
            with tqdm.external_write_mode():  # the line above the bar, not through it
                log(f"[retrofit] fit {label}: layer {li} ({i}/{len(layers)}) {shown} ({(time.time() - start) / 60:.1f} min)")
    return rows


def fit_read(model: nn.Module, tokenizer: Any, recipe: Recipe, *, log: Callable[[str], None] = print,
             progress: bool = True) -> FitReport:
    """``recipe.fit``'s two parts on ``model`` (converted, by a method that declares ``fit``), in place: the maps, then
    the scale (a part with ``sequences: 0`` is skipped). Seeds: ``train.seed`` plus the layer index,
    so a layer's fit does not depend on the others. ``progress``: a progress bar on stderr (also
    off with ``logging.progress: false``)."""
    layers = fittable_layers(model)
    progress = progress and recipe.logging.progress
    report = FitReport()
    m, s = recipe.fit.maps, recipe.fit.scale
    seed = recipe.train.seed

    def gen(attn: nn.Module, offset: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed + offset + int(attn.layer_idx))

    if m.sequences and m.steps:
        seqs = fit_sequences(recipe, tokenizer, m.seq_len, m.sequences, m.recall_facts)
        report.maps = _part(model, layers, seqs, lambda a, x, tick: fit_maps(
            a, x, steps=m.steps, queries=m.queries, lr=m.lr, generator=gen(a, 0), on_step=tick),
            "maps", log, steps=m.steps, progress=progress)
        report.maps.update(asdict(m))
    if s.sequences:
        seqs = fit_sequences(recipe, tokenizer, s.seq_len, s.sequences, s.recall_facts)
        report.scale = _part(model, layers, seqs, lambda a, x, _tick: fit_scale(
            a, x, queries=s.queries, generator=gen(a, 10_000)), "scale", log, progress=progress)
        report.scale.update(asdict(s))
    for attn in layers:
        for p in (attn.feature_query.weight, attn.feature_key.weight, attn.memory_scale.weight):
            if not torch.isfinite(p).all():
                raise SpecError(f"layer {attn.layer_idx}: the fit gave non-finite weights; lower fit.maps.lr")
    return report


def report_json(report: FitReport, recipe: Recipe) -> str:
    """``fit.json``: the report and the recipe that made it."""
    return json.dumps({"maps": report.maps, "scale": report.scale, "recipe": recipe.to_dict()}, indent=1, default=str) + "\n"


def save_fitted(model: nn.Module, out: str | Path, recipe: Recipe, report: FitReport, *, overwrite: bool = False) -> Path:
    """Write the fitted model as a delta checkpoint (its new weights) in ``out``, atomically, with
    ``fit.json`` (:func:`report_json`) inside. Its base is ``model.name`` as the recipe names it when
    that is a base (an alias stays an alias), else the converted input's own base."""
    from retrofit.surgery import retrofit_record, save_delta
    from retrofit.surgery.loading import names_converted

    base = recipe.model.name if names_converted(recipe.model.name) is False else None
    base = base or (retrofit_record(model) or {}).get("base_model") or recipe.model.name
    return save_delta(model.to("cpu"), out, base_model=base, overwrite=overwrite,
                      extra_files={"fit.json": report_json(report, recipe)})


def run_fit(recipe: Recipe, out: str | Path, *, overwrite: bool = False,
            log: Callable[[str], None] = print, progress: bool = True) -> FitReport:
    """The whole of ``retrofit fit``: build the recipe's model (converted as its conversion section
    says, on CUDA when there is one), fit its read (:func:`fit_read`, ``progress``: its bar on stderr)
    and save it in ``out`` (:func:`save_fitted`); returns the report."""
    from retrofit.train.model import build_model, model_dtype

    cuda = torch.cuda.is_available()
    check_fittable_recipe(recipe)
    model, tokenizer = build_model(recipe, dtype=model_dtype(recipe, cuda), log=log)
    fittable_layers(model)  # a model of another method fails before any sequence is captured
    model.eval().to("cuda" if cuda else "cpu")
    report = fit_read(model, tokenizer, recipe, log=log, progress=progress)
    save_fitted(model, out, recipe, report, overwrite=overwrite)
    return report
