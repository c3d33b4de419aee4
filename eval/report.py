"""Results on disk: atomic JSON / markdown writes, tables, PNG plots, and the combined report.

Every evaluator writes into its ``--out`` folder: ``results.json`` (everything, machine
readable), ``table.md`` (the human table) and its PNGs. :func:`write_report` gathers the
sections of ``retrofit eval all`` into one ``report.md`` with relative image links.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

from retrofit.eval.evaluators import evaluators
from retrofit.fs.atomic import write_json_atomic, write_text_atomic
from retrofit.results import markdown_table, pyplot, write_results

__all__ = ["role_order", "fmt_length", "fmt_num", "label_cells", "markdown_table", "pyplot", "save_results", "write_json",
           "write_report", "write_results"]


def role_order(models: dict) -> list[str]:
    """The roles of a results file's ``models`` in table order: ``baseline`` first (as in the paper's
    tables), then the zero-shot variants in the order run, ``model`` last."""
    return sorted(models, key=lambda r: (r != "baseline", r == "model"))


def write_json(path: str | Path, obj: Any) -> Path:
    """``obj`` as JSON, inf/nan written as strings, atomically."""
    return write_json_atomic(path, obj, finite=True)


def save_results(out: str | Path, res: dict) -> tuple[Path, Path]:
    """An evaluator's ``results.json`` and ``table.md`` (its description above its table) in ``out``."""
    return write_results(out, res, res["description"] + "\n\n" + res["table"] + "\n")


def finish_results(res: dict, out: str | Path | None, plot: Callable[[dict, Path], Path | None], image: str) -> dict:
    """An evaluator's last step: its markdown table (``res["table"]`` must be set), and with ``out``
    its plot ``out/image`` (``plot`` may return None: nothing to draw) and :func:`save_results`."""
    res["images"] = []
    if out is not None:
        out = Path(out)
        res["out"] = str(out)
        if plot(res, out / image) is not None:
            res["images"] = [image]
        save_results(out, res)
    return res


def fmt_length(n: int) -> str:
    """4096 -> '4K', 1536 -> '1.5K', 1000 -> '1000'."""
    n = int(n)
    if n >= 1024 and n % 512 == 0:
        k = n / 1024
        return f"{k:g}K"
    return str(n)


def label_cells(ax: Any, data: Any) -> None:
    """Write each cell's value of a heat map of fractions ``data`` ``(rows, columns)`` on ``ax``, in
    percent, and ``OOM`` where it is nan (a length that ran out of memory)."""
    import numpy as np

    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            v = data[i, j]
            ax.text(j, i, "OOM" if np.isnan(v) else f"{100 * v:.0f}", ha="center", va="center", fontsize=8)


def fmt_num(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if abs(x) >= 1e5:
        return f"{x:.3g}"
    return f"{x:.{digits}f}"


def write_report(
    out_dir: str | Path,
    sections: dict[str, dict] | None = None,
    *,
    title: str = "Evaluation report",
    preamble: str = "",
) -> dict:
    """Combine evaluator results into ``out_dir/report.md``; returns ``{"path", "markdown"}``.

    ``sections`` maps an evaluator name (``perplexity``, ``harness``, ``passkey``: see
    :mod:`retrofit.eval.evaluators`, which gives each its heading and order) to its result dict
    (each carries its ``out`` folder, its table and its images). Without ``sections``,
    ``out_dir/*/results.json`` are read.
    """
    out_dir = Path(out_dir)
    if sections is None:
        sections = {}
        for p in sorted(out_dir.glob("*/results.json")):
            res = json.loads(p.read_text())
            res.setdefault("out", str(p.parent))
            sections[res.get("kind", p.parent.name)] = res
    kinds = [ev for ev in evaluators() if ev.name in sections]
    headings = {ev.name: ev.heading for ev in kinds}
    parts = [f"# {title}", ""]
    if preamble:
        parts += [preamble.strip(), ""]
    for kind in (*headings, *[k for k in sections if k not in headings]):
        res = sections.get(kind)
        if not res:
            continue
        parts += [f"## {headings.get(kind, kind)}", ""]
        if res.get("description"):
            parts += [res["description"], ""]
        parts += [res.get("table", "").strip(), ""]
        for img in res.get("images", []):
            rel = os.path.relpath(Path(res.get("out", out_dir)) / img, out_dir)
            parts += [f"![{Path(img).stem}]({rel})", ""]
        if res.get("command"):
            parts += ["Command:", "", "```", res["command"], "```", ""]
    markdown = "\n".join(parts).rstrip() + "\n"
    path = write_text_atomic(out_dir / "report.md", markdown)
    return {"path": str(path), "markdown": markdown, "sections": sorted(sections)}
