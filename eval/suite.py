"""``retrofit eval all``: perplexity sweep, lm-eval benchmarks and passkey, then one report.

Models are loaded once and shared by the three evaluators; each writes its own sub-folder
(``ppl/``, ``harness/``, ``passkey/``) and :func:`retrofit.eval.report.write_report` gathers
their tables and images into ``report.md``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from retrofit.errors import RetrofitError
from retrofit.eval import loading, report

SECTIONS = ("perplexity", "harness", "passkey")
SUBDIRS = {"perplexity": "ppl", "harness": "harness", "passkey": "passkey"}


def run_all(
    model: Any,
    *,
    tokenizer: Any = None,
    baseline: Any = None,
    baseline_tokenizer: Any = None,
    out: str | Path,
    skip: tuple[str, ...] | list[str] = (),
    perplexity: dict | None = None,
    harness: dict | None = None,
    passkey: dict | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    title: str | None = None,
    command: str | None = None,
) -> dict:
    """Run the selected evaluators into ``out/<section>`` and write ``out/report.md``.

    perplexity / harness / passkey: keyword arguments for :func:`run_perplexity`,
    :func:`run_harness`, :func:`run_passkey`. skip: sections to leave out.
    Returns ``{"report": path, "markdown": ..., "perplexity": {...}, ...}``.
    """
    from retrofit.eval.harness import run_harness
    from retrofit.eval.passkey import run_passkey
    from retrofit.eval.perplexity import run_perplexity

    unknown = set(skip) - set(SECTIONS)
    if unknown:
        raise RetrofitError(f"cannot skip {sorted(unknown)}: sections are {', '.join(SECTIONS)}")
    out = Path(out)
    m, tok, m_label = loading.resolve(model, tokenizer, device=device, dtype=dtype)
    common: dict[str, Any] = {"tokenizer": tok, "device": device}
    if baseline is not None:
        b, btok, b_label = loading.resolve(baseline, baseline_tokenizer, device=device, dtype=dtype)
        common.update(baseline=b, baseline_tokenizer=btok)
    runners = {"perplexity": (run_perplexity, perplexity), "harness": (run_harness, harness),
               "passkey": (run_passkey, passkey)}
    sections: dict[str, dict] = {}
    for name in SECTIONS:
        if name in skip:
            continue
        fn, kwargs = runners[name]
        sections[name] = fn(m, out=out / SUBDIRS[name], **common, **(kwargs or {}))
    title = title or f"Evaluation: {m_label}" + (f" vs {b_label}" if baseline is not None else "")
    pre = f"Command: `{command}`" if command else ""
    rep = report.write_report(out, sections, title=title, preamble=pre)
    return {"report": rep["path"], "markdown": rep["markdown"], **sections}
