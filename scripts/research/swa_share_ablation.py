#!/usr/bin/env python
"""Measure which initial sliding-window share p(0|t) a Latte Macchiato retrofit should start from.

For each share, the recipe (default: the CPU Gemma 3 270M run) trains from the converted,
untrained model with the same steps, seed and data; its held-out loss on the recipe's held-out
books is recorded before training (step 0 = the converted-but-untrained model) and every
``eval.every`` steps. The unconverted base model scored on the very same sequences is the
reference line.

    python scripts/research/swa_share_ablation.py --shares 0.5 0.9
    python scripts/research/swa_share_ablation.py --shares 0.5 0.9 train.max_steps=60   # recipe overrides

Writes OUT/ablation.json and a PNG (held-out and training loss per step), prints a markdown table.
A killed ablation continues where it stopped (each share's run resumes from its checkpoints).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from retrofit.fs.atomic import save_figure_atomic, write_json_atomic

REPO = Path(__file__).resolve().parents[2]


@torch.no_grad()
def mean_loss(model: torch.nn.Module, sequences: list[torch.Tensor]) -> float:
    """Token-weighted next-token loss over ``(seq_len,)`` sequences, one at a time."""
    total = count = 0.0
    model.eval()
    for seq in sequences:
        x = seq[None]
        total += float(model(input_ids=x, labels=x).loss) * (x.shape[1] - 1)
        count += x.shape[1] - 1
    return total / count


def base_reference(recipe) -> float:
    from retrofit.surgery import load_any
    from retrofit.train.data import data_files, heldout_sequences

    model, tokenizer = load_any(recipe.model.name, dtype=torch.float32)
    sequences, _ = heldout_sequences(recipe, tokenizer, data_files(recipe))
    return mean_loss(model, sequences)


def plot(results: dict, base: float | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for share, r in results.items():
        ax1.plot([e["step"] for e in r["evals"]], [e["loss"] for e in r["evals"]], marker="o", label=f"init share {share}")
        steps, losses = [h["step"] for h in r["train"]], [h["loss"] for h in r["train"]]
        ema, smooth = None, []
        for v in losses:
            ema = v if ema is None else 0.8 * ema + 0.2 * v
            smooth.append(ema)
        line, = ax2.plot(steps, losses, alpha=0.25, lw=1)
        ax2.plot(steps, smooth, color=line.get_color(), label=f"init share {share} (EMA 0.8)")
    if base is not None:
        ax1.axhline(base, color="k", ls="--", lw=1, label="base model (full attention)")
    ax1.set(xlabel="optimizer step", ylabel="held-out loss (nats/token)", title="held-out books")
    ax2.set(xlabel="optimizer step", ylabel="training loss", title="training batches")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure_atomic(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(REPO / "configs" / "gemma3-270m-macchiato-cpu.yaml"))
    p.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.9])
    p.add_argument("--out", default="runs/swa-share-ablation", help="run folders and ablation.json")
    p.add_argument("--plot", default=str(REPO / "docs" / "swa_share_ablation.png"))
    p.add_argument("--no-base", action="store_true", help="skip scoring the unconverted base model")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)

    from retrofit.train.entry import train
    from retrofit.train.metrics import read_metrics
    from retrofit.train.recipe import load_recipe

    out = Path(args.out)
    results: dict[str, dict] = {}
    for share in args.shares:
        run_dir = out / f"share-{share:g}"
        recipe = load_recipe(args.recipe, [*args.overrides, f"conversion.init_swa_share={share}",
                                           f"checkpoint.output_dir={run_dir}", "checkpoint.export=false"])
        t0 = time.time()
        result = train(recipe)
        metrics = run_dir / "metrics.jsonl"
        history = read_metrics(metrics, "train")
        results[f"{share:g}"] = {
            "evals": read_metrics(metrics, "eval"), "train": history,
            "steps": result.steps, "tokens": result.tokens,
            # optimizer-step time over the whole run (a resumed run's earlier steps included);
            # wall_s is this invocation only
            "train_s": round(sum(h.get("step_time_s", 0.0) for h in history), 1),
            "wall_s": round(time.time() - t0, 1), "trainable": result.counts.trainable,
        }
    recipe = load_recipe(args.recipe, args.overrides)
    base = None if args.no_base else base_reference(recipe)

    steps = next(iter(results.values()))["steps"]
    title = (f"{recipe.model.name} -> Latte Macchiato (w {recipe.conversion.get('window')}, L {recipe.conversion.get('latents')}): "
             f"{steps} steps x {recipe.train.batch_size} x {recipe.data.seq_len} tokens, lr {recipe.train.lr:g}")
    plot(results, base, Path(args.plot), title)
    summary = {"command": " ".join(["python", "scripts/research/swa_share_ablation.py", *(argv if argv is not None else sys.argv[1:])]),
               "recipe": str(args.recipe), "overrides": args.overrides, "base_heldout_loss": base, "shares": results}
    write_json_atomic(out / "ablation.json", summary, indent=2, default=None)

    print("\n| init SWA share | held-out loss, untrained | after {} steps | change | step time |".format(steps))
    print("|---|---|---|---|---|")
    for share, r in results.items():
        first, last = r["evals"][0]["loss"], r["evals"][-1]["loss"]
        print(f"| {share} | {first:.4f} (ppl {math.exp(first):.2f}) | {last:.4f} (ppl {math.exp(last):.2f}) "
              f"| {last - first:+.4f} | {r['train_s'] / 60:.1f} min |")
    if base is not None:
        print(f"| base model | {base:.4f} (ppl {math.exp(base):.2f}) | | | |")
    print(f"\nplot: {args.plot}; numbers: {out / 'ablation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
