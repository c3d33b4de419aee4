"""Perplexity sweep over context lengths, a model beside its baseline (the paper's Table 4).

The token windows are built once (from the model's tokenizer; the baseline must tokenize the
same way) and both models score exactly the same windows. See :mod:`retrofit.eval.windows` for
the protocols and :mod:`retrofit.eval.nll` for how memory stays bounded at 16K-32K tokens.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from retrofit.errors import DataError
from retrofit.eval import corpora, loading, nll, report
from retrofit.eval import variants as variants_mod
from retrofit.eval.options import run_options
from retrofit.eval.windows import Window, build_windows
from retrofit.fs.atomic import save_figure_atomic

DEFAULT_LENGTHS = (4096, 8192, 16384)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "not enough memory" in msg)


class PrefixCache:
    """Per-token NLLs of scored windows, keyed by (document, start), for prefix reuse.

    Under the ``windows`` protocol, window 0 of a document at length L is the first L tokens of
    window 0 at every longer length. A causal model's NLL of a token depends only on the tokens
    before it, so the first L-1 per-token NLLs of the longer window are the shorter window's own
    (equal up to float rounding: the kernels see other shapes). One 64K pass then scores 1K-64K.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, int]] = {}

    def lookup(self, w: Window) -> tuple[torch.Tensor, int] | None:
        """``(per-token NLL [L-1], source length)`` if a scored window starts with ``w``'s tokens."""
        hit = self._entries.get((w.doc_id, w.start))
        if hit is None:
            return None
        ids, per_token, length = hit
        L = w.input_ids.numel()
        if length < L or not torch.equal(ids[:L], w.input_ids):
            return None
        return per_token[: L - 1], length

    def store(self, w: Window, per_token: torch.Tensor) -> None:
        key = (w.doc_id, w.start)
        old = self._entries.get(key)
        if old is None or old[2] < w.input_ids.numel():
            self._entries[key] = (w.input_ids, per_token, int(w.input_ids.numel()))


def score_windows(
    model: Any,
    windows: list[Window],
    *,
    chunk_size: int | None = None,
    slice_tokens: int | None = None,
    sliced: bool = True,
    progress=None,
    prefixes: PrefixCache | None = None,
) -> dict:
    """Perplexity of ``model`` over ``windows`` (all one length): ppl, nll, tokens, seconds.

    ``prefixes``: reuse (and record) per-token NLLs of longer windows these windows begin
    (``reused_windows`` counts them; ``seconds`` covers only the windows run here).
    On out-of-memory the entry has ``"error": "OOM"`` and ``ppl`` None.
    """
    total, count, run_count, reused, sources = 0.0, 0, 0, 0, set()
    per_window = []
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        for w in windows:
            hit = prefixes.lookup(w) if prefixes is not None else None
            if hit is not None:
                per_token, source = hit
                reused += 1
                sources.add(source)
            elif sliced:
                per_token = nll.window_token_nll(model, w.input_ids, chunk_size=chunk_size, slice_tokens=slice_tokens)
            else:
                per_token = nll.window_token_nll_full(model, w.input_ids)
            s, n = float(per_token.sum()), int(per_token.numel())
            if hit is None:
                run_count += n
                if prefixes is not None:
                    prefixes.store(w, per_token)
            total, count = total + s, count + n
            per_window.append(nll.perplexity(s, n))
            if progress is not None:
                progress.update(1)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {
            "ppl": None, "error": "OOM", "windows": len(windows), "scored": len(per_window),
            "detail": str(exc)[:300],
        }
    seconds = time.perf_counter() - t0
    peak = {"peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {}
    entry = {
        **peak,
        "ppl": nll.perplexity(total, count),
        "nll_sum": total,
        "tokens": count,
        "windows": len(windows),
        "window_ppl": per_window,
        "seconds": seconds,
    }
    if reused:
        entry["reused_windows"] = reused
        entry["reused_from_lengths"] = sorted(sources)
    if run_count:
        entry["tokens_per_second"] = run_count / seconds if seconds > 0 else None
    return entry


# what a copied entry keeps of its source's (time and throughput belong to the run that made them)
_COPIED = ("ppl", "nll_sum", "tokens", "windows", "window_ppl")


def _peak_rss_mib() -> float | None:
    """Peak resident memory of this process so far (Linux/macOS), in MiB."""
    try:
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**20 if sys.platform == "darwin" else rss / 2**10
    except Exception:  # pragma: no cover - platform without resource
        return None


def run_perplexity(
    model: Any,
    *,
    datasets: list[str] | tuple[str, ...] = ("pg-books",),
    lengths: list[int] | tuple[int, ...] = DEFAULT_LENGTHS,
    protocol: str | None = None,
    max_windows: int | None = 8,
    max_docs: int | None = None,
    bos: str = "auto",
    chunk_size: int | None = None,
    baseline_chunk_size: int | None = None,
    logit_budget: int = nll.DEFAULT_LOGIT_BUDGET,
    text_field: str | None = None,
    reuse_prefixes: bool = True,
    zero_shot: list[str] | tuple[str, ...] = (),
    **options: Any,
) -> dict:
    """Perplexity at each length on each dataset for ``model`` (and ``baseline``), same windows.

    model / baseline: a name or path (loaded with :func:`retrofit.eval.loading.load_model`) or
        a loaded model (then pass its tokenizer).
    datasets: registry names (configs/datasets.yaml) or local .txt/.jsonl files or folders.
    protocol: ``windows`` or ``packed``; None takes each dataset's registry default.
    max_windows: cap on windows per (dataset, length); None = every window.
    bos: ``auto`` | ``always`` | ``never`` (auto: what the tokenizer does; always for Gemma).
    chunk_size: forward the model ``chunk_size`` tokens at a time through its cache
        (``baseline_chunk_size`` for the baseline; None = one forward per window).
    logit_budget: fp32 logits held at once (elements); sets the lm_head slice size.
    reuse_prefixes: score lengths longest first and take a window that begins a longer scored
        window (window 0 of a document at every length) from that window's per-token NLLs
        (see :class:`PrefixCache`); False runs every window on its own. Length-dependent variants
        (dynamic NTK) never reuse prefixes.
    zero_shot: variant specs scored beside the two (:mod:`retrofit.eval.variants`): ``yarn:4``,
        ``dynamic:4``, ``linear:4``, ``cap:8191`` on the baseline; ``closed`` on the model.
    options: device, dtype, rope_cap (applied to both models), out (the folder for results.json,
        table.md, perplexity.png, written atomically), progress, command
        (:class:`retrofit.eval.options.RunOptions`).

    Returns the results dict (also written to ``out/results.json``).
    """
    from tqdm.auto import tqdm

    opts = run_options("run_perplexity", options)
    lengths = sorted(set(int(x) for x in lengths))
    resolved = opts.roles(model, zero_shot)
    m, tok, _ = resolved["model"]
    roles: dict[str, tuple[Any, str, int | None]] = {
        role: (mdl, label, chunk_size if role.startswith("model") else baseline_chunk_size)
        for role, (mdl, _, label) in resolved.items()
    }
    use_bos = loading.needs_bos(m, tok, bos)
    bos_id = tok.bos_token_id if use_bos else None

    # 1. windows, once, shared by every model
    all_windows: dict[str, dict[int, list[Window]]] = {}
    ds_info: dict[str, dict] = {}
    specs = [corpora.resolve_corpus(n, protocol=protocol, text_field=text_field) for n in datasets]
    names = [s.name for s in specs]
    names = names if len(set(names)) == len(names) else list(datasets)  # display names, unique
    for name, spec in zip(names, specs):
        if not spec.is_local and max_windows is None and max_docs is None:
            raise DataError(
                f"dataset {name!r} is streamed from the hub: set a window cap (--max-windows) or "
                f"--max-docs, or the whole split would be read"
            )
        docs = corpora.iter_documents(spec, max_docs=max_docs)
        wins = build_windows(
            docs, tok, lengths, protocol=spec.protocol, max_windows=max_windows,
            bos_id=bos_id, eos_id=tok.eos_token_id,
        )
        all_windows[name] = wins
        ds_info[name] = {**spec.describe(), "windows": {str(L): [w.describe() for w in wins[L]] for L in lengths}}
    if not any(ws for per in all_windows.values() for ws in per.values()):  # a table of "no windows" alone
        raise DataError(f"nothing to score: {', '.join(names)} hold{'s' * (len(names) == 1)} no window of {lengths[0]} tokens (the shortest "
                        f"--lengths; a window lies inside one document unless --protocol packed): give a longer "
                        f"text or a shorter length")

    # 2. score them
    datasets = names
    results: dict[str, dict[str, dict]] = {ds: {str(L): {} for L in lengths} for ds in datasets}
    n_total = sum(len(w) for per in all_windows.values() for w in per.values()) * len(roles)
    bar = tqdm(total=n_total, desc="perplexity", unit="window", disable=not opts.progress)
    attention: dict[str, str | None] = {}
    copied = variants_mod.copied_roles(resolved)
    for role in variants_mod.scoring_order(resolved):
        mdl, label, chunk = roles[role]
        with loading.scoring_attention(mdl) as attention[role]:
            variant = variants_mod.variant_of(role)
            _score_role(
                role, mdl, label, chunk, datasets, lengths, all_windows, results, logit_budget=logit_budget,
                reuse_prefixes=reuse_prefixes and not (variant is not None and variant.length_dependent), bar=bar,
                same_as=copied.get(role),
            )
    bar.close()

    res = {
        "kind": "perplexity",
        "process_peak_rss_mib": _peak_rss_mib(),
        "models": {role: loading.model_info(mdl, label) for role, (mdl, label, _) in roles.items()},
        "settings": {
            "lengths": lengths,
            "protocol": protocol or "registry default",
            "max_windows": max_windows,
            "bos": bos,
            "bos_used": use_bos,
            "chunk_size": chunk_size,
            "baseline_chunk_size": baseline_chunk_size,
            "logit_budget": logit_budget,
            "reuse_prefixes": reuse_prefixes,
            "zero_shot": [v.spec for v in variants_mod.parse_variants(zero_shot)],
            "attention": attention,
            "device": opts.device,
            "dtype": opts.dtype,
        },
        "datasets": ds_info,
        "results": results,
    }
    return opts.finish(res, description=describe(res), table=table_markdown, plot=plot_perplexity,
                       image="perplexity.png")



def _score_role(
    role: str,
    mdl: Any,
    label: str,
    chunk: int | None,
    datasets: list[str],
    lengths: list[int],
    all_windows: dict[str, dict[int, list[Window]]],
    results: dict[str, dict[str, dict]],
    *,
    logit_budget: int,
    reuse_prefixes: bool,
    bar: Any,
    same_as: tuple[str, int] | None = None,
) -> None:
    """Score every window of every dataset for one model; fills ``results[ds][L][role]``.

    same_as: ``(source role, tokens)``: lengths of at most ``tokens`` are the source's results,
    copied (:func:`retrofit.eval.variants.copied_roles`), not run.
    """
    slice_tokens = nll.slice_tokens_for(mdl.get_output_embeddings().weight.shape[0], logit_budget)
    probe = next((w.input_ids for per in all_windows.values() for ws in per.values() for w in ws), None)
    sliced = nll.check_sliced_head(mdl, probe) if probe is not None else True
    for ds in datasets:
        oom = False
        prefixes = PrefixCache() if reuse_prefixes else None
        # longest first when reusing prefixes; else shortest first, and an OOM ends the sweep
        for L in sorted(lengths, reverse=reuse_prefixes):
            wins = all_windows[ds][L]
            bar.set_postfix_str(f"{label} {ds} {report.fmt_length(L)}")
            if not wins:
                results[ds][str(L)][role] = {"ppl": None, "windows": 0, "error": "no windows"}
                continue
            source = results[ds][str(L)].get(same_as[0]) if same_as is not None and L <= same_as[1] else None
            if source is not None and source.get("ppl") is not None:
                results[ds][str(L)][role] = {**{k: source[k] for k in _COPIED if k in source}, "same_as": same_as[0]}
                bar.update(len(wins))
                continue
            if oom:  # a longer window will not fit either
                results[ds][str(L)][role] = {"ppl": None, "windows": len(wins), "error": "OOM"}
                bar.update(len(wins))
                continue
            entry = score_windows(
                mdl, wins, chunk_size=chunk, slice_tokens=slice_tokens, sliced=sliced, progress=bar,
                prefixes=prefixes,
            )
            if entry.get("error") == "OOM":
                oom = not reuse_prefixes
                bar.update(len(wins) - entry["scored"])
            results[ds][str(L)][role] = entry


def describe(res: dict) -> str:
    s = res["settings"]
    parts = []
    for ds, info in res["datasets"].items():
        counts = ", ".join(f"{report.fmt_length(int(L))}: {len(w)}" for L, w in info["windows"].items())
        parts.append(f"{ds} ({info['protocol']}; windows {counts})")
    bos = "BOS first" if s["bos_used"] else "no BOS"
    reused = any(e.get("reused_windows") for per_len in res["results"].values()
                 for roles in per_len.values() for e in roles.values())
    note = (" A window that begins a longer scored window takes its per-token NLLs from that window's "
            "forward (causal models; --no-reuse-prefixes runs it alone).") if reused else ""
    if any(e.get("same_as") for per_len in res["results"].values() for roles in per_len.values() for e in roles.values()):
        note += (" '= base': a zero-shot variant that computes exactly what the base does at that length (a RoPE "
                 "cap N below N + 1 tokens, dynamic NTK within the pretraining context) has the base's "
                 "numbers, not run again.")
    return (
        f"Perplexity (lower is better) on exactly-L-token windows, {bos}; the model and the baseline "
        f"score the same windows. Datasets: " + "; ".join(parts) + "." + note
    )


def table_markdown(res: dict) -> str:
    """Two models: rows are datasets, columns lengths grouped by model (baseline first), as in the
    paper's Table 4. More (zero-shot variants): one row per dataset and model, columns lengths."""
    lengths = res["settings"]["lengths"]
    roles = report.role_order(res["models"])

    def cell(e: dict) -> str:
        if e.get("same_as"):
            return "= base"
        return e.get("error") if e.get("ppl") is None and e.get("error") else report.fmt_num(e.get("ppl"))

    if len(roles) > 2:
        header = ["Dataset", "Model"] + [report.fmt_length(L) for L in lengths]
        rows = [[ds, res["models"][role]["label"]] + [cell(per_len[str(L)].get(role, {})) for L in lengths]
                for ds, per_len in res["results"].items() for role in roles]
        return report.markdown_table(header, rows, align=["l", "l"] + ["r"] * len(lengths))
    header = ["Dataset"]
    for role in roles:
        header += [f"{res['models'][role]['label']} {report.fmt_length(L)}" for L in lengths]
    rows = []
    for ds, per_len in res["results"].items():
        row = [ds]
        for role in roles:
            for L in lengths:
                row.append(cell(per_len[str(L)].get(role, {})))
        rows.append(row)
    return report.markdown_table(header, rows)


def plot_perplexity(res: dict, path: str | Path) -> Path:
    """Perplexity vs length (log-log). Two models: one colour per dataset, solid = model, dashed =
    baseline; more: one colour per model, one line style per dataset."""
    plt = report.pyplot()
    lengths = res["settings"]["lengths"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    all_ys: list[float] = []
    roles = report.role_order(res["models"])
    many = len(roles) > 2  # one colour per model, one line style per dataset
    lines, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D", "v", "P", "X")
    for i, (ds, per_len) in enumerate(res["results"].items()):
        for j, role in enumerate(roles):
            xs, ys = [], []
            for L in lengths:
                p = per_len[str(L)].get(role, {}).get("ppl")
                if isinstance(p, (int, float)) and p == p and p != float("inf"):
                    xs.append(L)
                    ys.append(p)
            if xs:
                all_ys += ys
                if many:
                    ls, mk, color = lines[i % len(lines)], markers[j % len(markers)], colors[j % len(colors)]
                else:  # one colour per dataset: solid = model, dashed = baseline
                    ls, mk = ("-", "o") if role == "model" else ("--", "s")
                    color = colors[i % len(colors)]
                name = res["models"][role]["label"] + (f" - {ds}" if len(res["results"]) > 1 or not many else "")
                ax.plot(xs, ys, ls, marker=mk, color=color, label=name)
    trained = (res["models"].get("baseline") or {}).get("max_position_embeddings")
    if trained and lengths and min(lengths) < trained <= max(lengths) * 2:
        # where the base model's pretraining context ends: past it, its curve may rise
        ax.axvline(trained, color="grey", linestyle=":", linewidth=1)
        ax.annotate("base's trained context", (trained, 0.98), xycoords=("data", "axes fraction"),
                    ha="right", va="top", rotation=90, fontsize=7, color="grey")
    ax.set_xscale("log", base=2)
    if all_ys and max(all_ys) / max(min(all_ys), 1e-9) > 5:  # log only when curves span a wide range
        from matplotlib.ticker import ScalarFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.minorticks_off()
    ax.set_xticks(lengths)
    ax.set_xticklabels([report.fmt_length(L) for L in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity vs context length")
    ax.grid(True, which="both", alpha=0.3)
    if all_ys:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no windows scored", ha="center", va="center", transform=ax.transAxes)
    path = save_figure_atomic(fig, path)
    plt.close(fig)
    return path
