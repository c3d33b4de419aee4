"""``retrofit eval all``: perplexity sweep, lm-eval benchmarks and passkey, then one report.

Models are loaded once and shared by the registered evaluators (:mod:`retrofit.eval.evaluators`);
each writes its own sub-folder (``ppl/``, ``harness/``, ``passkey/``) and :func:`retrofit.eval.report.write_report` gathers
their tables and images into ``report.md``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from retrofit.errors import RetrofitError
from retrofit.eval import loading, report
from retrofit.eval.evaluators import evaluators
from retrofit.eval.variants import takes_zero_shot



def run_all(
    model: Any,
    *,
    tokenizer: Any = None,
    baseline: Any = None,
    baseline_tokenizer: Any = None,
    out: str | Path,
    skip: tuple[str, ...] | list[str] = (),
    device: str = "cpu",
    dtype: str | None = None,
    rope_cap: int | None = None,
    title: str | None = None,
    command: str | None = None,
    zero_shot: list[str] | tuple[str, ...] = (),
    **sections: dict | None,
) -> dict:
    """Run every registered evaluator (:mod:`retrofit.eval.evaluators`) into ``out/<subdir>`` and
    write ``out/report.md``.

    ``perplexity=``, ``harness=``, ``passkey=`` (one keyword per evaluator name): keyword arguments
    for that evaluator's run function (:func:`run_perplexity`, :func:`run_harness`,
    :func:`run_passkey`). skip: evaluator names to leave out.
    Returns ``{"report": path, "markdown": ..., "perplexity": {...}, ...}``.
    """
    kinds = evaluators()
    names = [ev.name for ev in kinds]
    unknown = set(skip) - set(names)
    if unknown:
        raise RetrofitError(f"cannot skip {sorted(unknown)}: sections are {', '.join(names)}")
    extra = set(sections) - set(names)
    if extra:
        raise RetrofitError(f"run_all got options for {sorted(extra)}, which are not evaluators "
                            f"({', '.join(names)})")
    out = Path(out)
    m, tok, m_label = loading.resolve(model, tokenizer, device=device, dtype=dtype, rope_cap=rope_cap)
    common: dict[str, Any] = {"tokenizer": tok, "device": device}
    if baseline is not None:
        b, btok, b_label = loading.resolve(baseline, baseline_tokenizer, device=device, dtype=dtype, rope_cap=rope_cap)
        common.update(baseline=b, baseline_tokenizer=btok)
    if zero_shot:  # each evaluator that takes them builds its variants (copies of the models loaded here)
        common["zero_shot"] = list(zero_shot)
    for ev in kinds:  # what needs the tokenizer fails now, before the first kind's minutes and results
        precheck = None if ev.name in skip else ev.prechecker()
        if precheck is not None:
            precheck(m, tokenizer=tok, **(sections.get(ev.name) or {}))
    results: dict[str, dict] = {}
    for ev in kinds:
        if ev.name in skip:
            continue
        runner = ev.runner()
        kwargs = common if takes_zero_shot(runner) else {k: v for k, v in common.items() if k != "zero_shot"}
        results[ev.name] = runner(m, out=out / ev.subdir, **kwargs, **(sections.get(ev.name) or {}))
    title = title or f"Evaluation: {m_label}" + (f" vs {b_label}" if baseline is not None else "")
    pre = f"Command: `{command}`" if command else ""
    rep = report.write_report(out, results, title=title, preamble=pre)
    return {"report": rep["path"], "markdown": rep["markdown"], **results}
