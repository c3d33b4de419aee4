"""Results on disk, shared by ``retrofit eval`` and ``retrofit bench``: one markdown-table writer,
one results writer (``results.json`` + a markdown file, both atomic) and headless plotting.

Depends only on :mod:`retrofit.fs` and the standard library, so every tier may use it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from retrofit.fs.atomic import _json_default, write_json_atomic, write_text_atomic

__all__ = ["markdown_table", "pyplot", "write_results"]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: Sequence[str] | None = None, *,
                   pad: bool = False, cell: Callable[[Any], str] = str) -> str:
    """A GitHub-flavoured markdown table.

    ``align`` items are ``'l'`` or ``'r'`` (default: first column left, the rest right). ``pad``
    pads every cell to its column's width so the raw text lines up (bench tables printed to a
    terminal). ``cell`` turns each row value into its text.
    """
    header = [str(h) for h in header]
    body = [[cell(c) for c in r] for r in rows]
    align = list(align) if align is not None else ["l"] + ["r"] * (len(header) - 1)
    if pad:
        widths = [max(4, len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    else:
        widths = [4] * len(header)

    def line(cells: Sequence[str]) -> str:
        if pad:
            cells = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)]
        return "| " + " | ".join(cells) + " |"

    seps = [":" + "-" * (w - 1) if a == "l" else "-" * (w - 1) + ":" for w, a in zip(widths, align)]
    return "\n".join([line(header), "| " + " | ".join(seps) + " |", *(line(r) for r in body)])


def write_results(
    out_dir: str | os.PathLike,
    results: dict,
    markdown: str,
    *,
    markdown_name: str = "table.md",
    json_name: str = "results.json",
    finite: bool = True,
    json_default: Callable[[Any], Any] | None = _json_default,
) -> tuple[Path, Path]:
    """Write ``results`` as ``out_dir/results.json`` and ``markdown`` as ``out_dir/table.md`` (atomic).

    ``finite`` writes inf/nan as strings (JSON has none). Returns ``(json_path, markdown_path)``;
    images are written by their plot functions with :func:`retrofit.fs.atomic.save_figure_atomic` beside them.
    """
    out = Path(out_dir)
    md = write_text_atomic(out / markdown_name, markdown if markdown.endswith("\n") else markdown + "\n")
    js = write_json_atomic(out / json_name, results, finite=finite, default=json_default)
    return js, md


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend (headless machines)."""
    from retrofit.extras import require

    matplotlib = require("matplotlib", "plots (PNG files)")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt
