"""Tracked files speak of versions, dates and commits, never of internal work periods (by ordinal)
or of the tasks behind a change (by number, or as "the" / "this" one): they mean nothing to a reader
of the project, who should read what a target or a measurement is instead. The pattern and its
examples are built from parts, so that neither this file nor a grep of the repository matches them."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["README.md", "BENCHMARKS.md", "benchmarks", "docs", "configs", "scripts", "retrofit", "eval",
         "patches", "tests", "Dockerfile", "pyproject.toml"]
THIRD_PARTY_TEXT = ("retrofit/data/pg-books/",)  # the bundled books: nineteenth-century prose, not ours to word
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth")
# a task named as a noun: "the ..." / "this ..." (its verb, as in "... a warning", is spared)
DETERMINERS = "this|that|the|these|those|previous|last|next|same|original"
# built from parts, so that this file does not match itself
PATTERN = re.compile(r"\b(?:(?:" + ORDINALS + r"|this|previous|last|next) " + "session" + r"s?\b"
                     r"|" + "issue" + r"s?[-_ ]?#?[0-9]+"
                     r"|(?:" + DETERMINERS + r") " + "issue" + r"(?:'s|s'?)?\b"
                     r"|" + "session" + r"s? [0-9]+)", re.IGNORECASE)


def _tracked_text_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", "--", *PATHS], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p and not p.startswith(THIRD_PARTY_TEXT)]


def test_no_file_names_work_periods_or_issue_numbers():
    hits = []
    for path in _tracked_text_files():
        if not path.is_file():
            continue  # deleted in the working tree
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            m = PATTERN.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, "use versions, dates or commits instead:\n" + "\n".join(hits)


S, I = "session", "issue"


@pytest.mark.parametrize("text", [f"the twelfth {S}", f"{I.title()} 13", f"{I}s 12", f"{S}s 3", f"the previous {S}",
                                  f"The {I}-2 targets", f"{I} #7", f"the {I} measured 81 s", f"as this {I} asks",
                                  f"the {I}'s numbers", f"These {I}s"])
def test_pattern_catches(text):
    assert PATTERN.search(text)


@pytest.mark.parametrize("text", ['@pytest.fixture(scope="session")', "a session token", "issue a warning",
                                  "it issues one request", "the issued token", "tissue 2"])
def test_pattern_spares(text):
    assert not PATTERN.search(text)
