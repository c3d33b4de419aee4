"""Results on disk: atomic JSON / markdown writes, tables, PNG plots, and the combined report.

Every evaluator writes into its ``--out`` folder: ``results.json`` (everything, machine
readable), ``table.md`` (the human table) and its PNGs. :func:`write_report` gathers the
sections of ``retrofit eval all`` into one ``report.md`` with relative image links.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write via a temp file in the same folder + rename: readers never see a half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _json_default(o: Any):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def _finite(o: Any) -> Any:
    """JSON has no inf/nan: write them as strings so every reader can parse the file."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(_finite(obj), indent=2, default=_json_default) + "\n")


def save_figure(fig, path: str | Path) -> Path:
    """Save a matplotlib figure atomically as PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=130, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (headless machines)."""
    from retrofit.extras import require

    matplotlib = require("matplotlib", "plots (PNG files)")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def fmt_length(n: int) -> str:
    """4096 -> '4K', 1536 -> '1.5K', 1000 -> '1000'."""
    n = int(n)
    if n >= 1024 and n % 512 == 0:
        k = n / 1024
        return f"{k:g}K"
    return str(n)


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


def markdown_table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    """A GitHub-flavoured markdown table; ``align`` items are 'l' or 'r'."""
    align = align or (["l"] + ["r"] * (len(header) - 1))
    seps = [":---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(seps) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_report(
    out_dir: str | Path,
    sections: dict[str, dict] | None = None,
    *,
    title: str = "Evaluation report",
    preamble: str = "",
) -> dict:
    """Combine evaluator results into ``out_dir/report.md``; returns ``{"path", "markdown"}``.

    ``sections`` maps a kind (``perplexity``, ``harness``, ``passkey``) to the result dict of
    ``run_perplexity`` / ``run_harness`` / ``run_passkey`` (each carries its ``out`` folder, its
    table and its images). Without ``sections``, ``out_dir/*/results.json`` are read.
    """
    out_dir = Path(out_dir)
    if sections is None:
        sections = {}
        for p in sorted(out_dir.glob("*/results.json")):
            res = json.loads(p.read_text())
            res.setdefault("out", str(p.parent))
            sections[res.get("kind", p.parent.name)] = res
    headings = {
        "perplexity": "Long-context perplexity",
        "harness": "Few-shot benchmarks (lm-eval)",
        "passkey": "Passkey retrieval",
    }
    parts = [f"# {title}", ""]
    if preamble:
        parts += [preamble.strip(), ""]
    for kind in ("perplexity", "harness", "passkey", *[k for k in sections if k not in headings]):
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
    path = atomic_write_text(out_dir / "report.md", markdown)
    return {"path": str(path), "markdown": markdown, "sections": sorted(sections)}
