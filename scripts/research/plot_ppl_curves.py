"""Overlay perplexity-vs-length curves from several `retrofit eval ppl` results.json files.

One curve per ``--series LABEL=WHO@FILE[,FILE...]``: WHO is ``model`` or ``baseline``; the files'
lengths are merged (a later file wins at a length both hold). ``FILE#KEY`` reads dataset KEY of that
file, else ``--dataset``, else the file's first dataset. The command behind
docs/hybrid_sink_cap_1k_128k.png is in scripts/research/README.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def curve(spec: str, dataset: str | None) -> tuple[str, dict[int, float]]:
    """``LABEL=WHO@FILE[,FILE...]`` -> (label, {length: perplexity})."""
    label, _, rest = spec.partition("=")
    who, _, files = rest.partition("@")
    if not (label and who in ("model", "baseline") and files):
        raise SystemExit(f"error: --series {spec!r}: write LABEL=model@FILE[,FILE] or LABEL=baseline@FILE[,FILE]")
    points: dict[int, float] = {}
    for item in files.split(","):
        file, _, key = item.partition("#")
        try:
            results = json.loads(Path(file).read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"error: {file}: not a readable `retrofit eval ppl` results.json ({exc}); "
                             "give the results.json an eval run wrote") from None
        key = key or dataset or next(iter(results))
        if key not in results:
            raise SystemExit(f"error: {file} has no dataset {key!r} (it has {', '.join(results)})")
        for length, row in results[key].items():
            ppl = row.get(who, {}).get("ppl")
            if ppl is not None:
                points[int(length)] = float(ppl)
    return label, dict(sorted(points.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", nargs="+", required=True, metavar="LABEL=WHO@FILE[,FILE]")
    parser.add_argument("--dataset", default=None, help="dataset key in results (default: each file's first)")
    parser.add_argument("--title", default="held-out perplexity vs window length")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [curve(spec, args.dataset) for spec in args.series]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points in curves:
        ax.plot(list(points), list(points.values()), marker="o", label=label)
        for x, y in points.items():
            ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for _, points in curves for x in points})
    ax.set_xticks(ticks, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
    ax.set_xlabel("window length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    from retrofit.fs.atomic import save_figure_atomic

    save_figure_atomic(fig, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
