"""A clone stands alone: nothing the package, its recipes, scripts or tests run reads a folder beside the
repository; the data they use ships inside the package (``bundled:NAME`` -> ``retrofit/data/NAME``)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from retrofit.data.paths import bundled_data_dir, expand_path
from retrofit.errors import SpecError

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./(?:\.\./)*shared\b|parents\[[2-9]\]\s*/\s*[\"']shared[\"']|RETROFIT_PG_BOOKS")
SCANNED = ("retrofit", "patches", "eval", "configs", "scripts", "tests", "Dockerfile", ".ci", "pyproject.toml")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", *SCANNED], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [REPO / f for f in out.stdout.split() if Path(f) != Path(__file__).relative_to(REPO)]


def test_no_code_recipe_or_test_reads_beside_the_repository():
    hits = []
    for f in _tracked():
        if f.suffix in {".txt", ".json", ".jsonl", ".png"} or not f.is_file():
            continue
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{f.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_guards_against():
    shared = "sha" + "red"  # built from parts, so that a grep of the repository does not match this file
    for text in (f"path: ../{shared}/data/pg-books", f"--books ../../../{shared}/data/pg-books",
                 f'Path(__file__).resolve().parents[3] / "{shared}" / "data"', "${RETROFIT_" + "PG_BOOKS:-x}"):
        assert OUTSIDE.search(text), text
    assert not OUTSIDE.search("values shared across a GQA group")


def test_the_bundled_books_are_in_the_package():
    books = bundled_data_dir() / "pg-books"
    names = sorted(p.name for p in books.glob("*.txt"))
    assert names == ["complete-angler.txt", "devils-dictionary.txt", "jack-sheppard.txt", "moby-dick.txt",
                     "news-from-nowhere.txt", "pride-and-prejudice.txt"]
    assert all((books / n).stat().st_size > 200_000 for n in names)
    assert expand_path("bundled:pg-books/moby-dick.txt", "/elsewhere") == books / "moby-dick.txt"
    with pytest.raises(SpecError, match="bundled:NAME"):
        expand_path("bundled:../errors.py", ".")


def test_setup_finds_every_package_of_the_four_roots():
    """Every folder with an ``__init__.py`` under retrofit/, patches/, eval/, configs/ goes into the wheel
    (scripts/check-wheel.sh builds one and checks its files)."""
    import runpy

    found = set(runpy.run_path(str(REPO / "setup.py"), run_name="not_main")["packages"]())
    roots = {"retrofit": "retrofit", "patches": "retrofit.patches", "eval": "retrofit.eval", "configs": "retrofit.configs"}
    for folder, name in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            assert ".".join((name, *rel)) in found, init
