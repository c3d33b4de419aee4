"""The import graph of retrofit/, patches/ and eval/ points one way and has no cycle.

Tiers, low to high (a module may import its own tier's lower rungs and any lower tier, never up):

    base    errors, extras, fs, results, data, catalog, precision, plugins, _hooks, _version   (no model code)
    ops     pure tensor math
    layers  nn.Modules with the new weights, and their decoding cache
    family  patches/ (how to reach q/k/v/o inside one model family)
    model   surgery/ (conversion, checkpoints, loading, the converted classes transformers loads),
            decoding/ (a compiled decoding step over a converted model)
    apps    train/, eval/, bench/  (siblings: none imports another)
    top     cli/, demo, the ``retrofit`` package's lazy facade

Every ``import`` counts, at module level or inside a function (a function-level import is still
an arrow; deferring it only hides a cycle). The graph is read with ``ast`` from the source
files, so nothing is imported. Exceptions are listed in ``ALLOWED`` with their reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"retrofit": "retrofit", "patches": "retrofit.patches", "eval": "retrofit.eval"}
DATA_PACKAGES = ("retrofit.configs",)  # YAML/JSON only: no code, no arrows

# (module prefix, tier, rank): the longest matching prefix decides
TIERS: list[tuple[str, str, int]] = [
    ("retrofit.errors", "base", 0),
    ("retrofit.extras", "base", 0),
    ("retrofit.fs", "base", 0),
    ("retrofit.results", "base", 0),
    ("retrofit.data", "base", 0),
    ("retrofit.catalog", "base", 0),
    ("retrofit._hooks", "base", 0),
    ("retrofit._version", "base", 0),
    ("retrofit.precision", "base", 0),
    ("retrofit.plugins", "base", 0),
    ("retrofit.ops", "ops", 1),
    ("retrofit.layers", "layers", 2),
    ("retrofit.patches", "family", 3),
    ("retrofit.surgery", "model", 4),
    ("retrofit.decoding", "model", 4),
    ("retrofit.train", "apps", 5),
    ("retrofit.eval", "apps", 5),
    ("retrofit.bench", "apps", 5),
    ("retrofit.cli", "top", 6),
    ("retrofit.demo", "top", 6),
    ("retrofit", "top", 6),  # the package __init__: a lazy facade over surgery (retrofit.convert, retrofit.load)
]
SIBLINGS = ("retrofit.train", "retrofit.eval", "retrofit.bench")  # same tier, must not import each other

# (importer, imported): arrows that stay, each with its reason. Keep this list short and named.
ALLOWED: dict[tuple[str, str], str] = {}

# Import cycles that stay for now (as frozensets of modules), each with its reason. Each is a mutual
# *call* (function-level imports), not a load-order problem; remove an entry when its cycle is broken
# (test_allowed_cycles_still_exist fails once it is).
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = f
    return mods


MODULES = _modules()


def _canonical(name: str) -> str | None:
    """The module of ours a dotted import name refers to (``patches.x`` -> ``retrofit.patches.x``)."""
    head = name.split(".")[0]
    if head in ("patches", "eval") and name not in MODULES:
        name = "retrofit." + name
    elif head != "retrofit":
        return None
    if name.startswith(DATA_PACKAGES):
        return None
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Modules of ours that ``module`` imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:  # a submodule if one exists by that name, else an attribute of source
                full = f"{source}.{a.name}"
                names.add(full if _canonical(full) in (full, "retrofit." + full) else source)
    out = {_canonical(n) for n in names}
    return {m for m in out if m is not None and m != module}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def tier(module: str) -> tuple[str, int]:
    best = max((p for p in TIERS if module == p[0] or module.startswith(p[0] + ".")), key=lambda p: len(p[0]))
    return best[1], best[2]


def _sibling(module: str) -> str | None:
    return next((s for s in SIBLINGS if module == s or module.startswith(s + ".")), None)


def test_every_module_has_a_tier():
    assert len(MODULES) > 50
    for m in MODULES:
        tier(m)  # max() of an empty sequence fails for an unmapped module


def test_no_upward_imports():
    bad = []
    for src, targets in GRAPH.items():
        for dst in targets:
            (s_name, s_rank), (d_name, d_rank) = tier(src), tier(dst)
            upward = d_rank > s_rank
            across = _sibling(src) and _sibling(dst) and _sibling(src) != _sibling(dst)
            if (upward or across) and (src, dst) not in ALLOWED:
                bad.append(f"{src} ({s_name}) imports {dst} ({d_name})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exporting its own submodules is not a cycle with them."""
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    return {m: {d for d in ds if not (m in packages and d.startswith(m + "."))
                and not (d in packages and m.startswith(d + "."))}
            for m, ds in graph.items()}


def test_no_import_cycles():
    cycles = [c for c in _cycles(_without_package_inits(GRAPH)) if frozenset(c) not in ALLOWED_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_arrows_it_must_see():
    """Guards against a checker that cannot fail: known arrows are in the graph, a planted cycle is found."""
    assert "retrofit.ops.latte" in GRAPH["retrofit.ops.exp_linear"]
    assert "retrofit.surgery.sources" in GRAPH["retrofit.surgery.checkpoint"]
    assert "retrofit.eval.report" in GRAPH["retrofit.eval.passkey"]  # ``from retrofit.eval import report``
    assert tier("retrofit.train.data") == ("apps", 5) and tier("retrofit.ops") == ("ops", 1)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_allowances_still_hold():
    """An allowed cycle that is gone (or has grown), or an allowed arrow that is gone, must be
    removed from ALLOWED_CYCLES / ALLOWED (both empty today: nothing is excepted)."""
    cycles = _cycles(_without_package_inits(GRAPH))
    gone = [sorted(c) for c in ALLOWED_CYCLES if sorted(c) not in cycles]
    gone += [f"{src} -> {dst}" for src, dst in sorted(ALLOWED) if dst not in GRAPH[src]]
    assert not gone, f"no longer true, update the allowances: {gone}"


def _package(module: str) -> str:
    """The floor a module lives on: its package under ``retrofit`` (``retrofit.ops.backends.fla`` -> ``retrofit.ops``)."""
    return ".".join(module.split(".")[:2])


def test_packages_form_floors():
    """Collapsed to packages (and the top-level modules), the import graph still has no cycle, so the
    house can be drawn floor by floor with every arrow pointing down: a module beside a package that
    both imports it and is imported by it (an arrow up) fails here even when the tiers above allow it."""
    floors: dict[str, set[str]] = {}
    for src, targets in GRAPH.items():
        floors.setdefault(_package(src), set()).update(_package(d) for d in targets if _package(d) != _package(src))
    cycles = _cycles(floors)
    assert not cycles, "packages importing each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_layering_has_no_exception():
    assert not ALLOWED and not ALLOWED_CYCLES
    assert _cycles({"retrofit.hf": {"retrofit.surgery"}, "retrofit.surgery": {"retrofit.hf"}})  # what the floors test sees
