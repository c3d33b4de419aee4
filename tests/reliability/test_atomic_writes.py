"""retrofit.fs.atomic: a failed write leaves the old file byte for byte and no temporary file behind."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from retrofit.fs import atomic
from retrofit.fs.atomic import atomic_file, write_bytes_atomic, write_json_atomic, write_text_atomic
from retrofit.results import markdown_table, write_results


def _only(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


class Boom(Exception):
    pass


def test_text_bytes_and_json_round_trip(tmp_path):
    assert write_text_atomic(tmp_path / "a" / "t.txt", "héllo\n").read_text(encoding="utf-8") == "héllo\n"
    assert write_bytes_atomic(tmp_path / "b.bin", b"\x00\xff").read_bytes() == b"\x00\xff"
    p = write_json_atomic(tmp_path / "c.json", {"b": 1, "a": [float("inf"), float("nan")], "p": Path("x")},
                          finite=True, sort_keys=True)
    text = p.read_text()
    assert text.endswith("\n") and text.index('"a"') < text.index('"b"')
    assert json.loads(text) == {"a": ["inf", "nan"], "b": 1, "p": "x"}
    assert _only(tmp_path) == ["a", "b.bin", "c.json"]


def test_json_without_finite_keeps_python_inf(tmp_path):
    p = write_json_atomic(tmp_path / "r.json", {"x": math.inf}, default=None)
    assert json.loads(p.read_text())["x"] == math.inf
    with pytest.raises(TypeError):  # no fallback encoder: nothing is written
        write_json_atomic(tmp_path / "r.json", {"x": object()}, default=None)
    assert json.loads(p.read_text())["x"] == math.inf and _only(tmp_path) == ["r.json"]


@pytest.mark.parametrize("mode", ["w", "wb"])
def test_failure_mid_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, mode):
    target = tmp_path / "results.json"
    target.write_bytes(b"old contents\n")
    with pytest.raises(Boom):
        with atomic_file(target, mode) as fh:
            fh.write("new, half written" if mode == "w" else b"new, half written")
            fh.flush()
            assert len(_only(tmp_path)) == 2  # the temp file exists beside the target while writing
            raise Boom
    assert target.read_bytes() == b"old contents\n"
    assert _only(tmp_path) == ["results.json"]


def test_failure_in_serialisation_keeps_the_old_file(tmp_path):
    target = write_text_atomic(tmp_path / "t.md", "old\n")

    class Bad:
        def __str__(self):
            raise Boom

    with pytest.raises(Boom):
        write_json_atomic(target, {"x": Bad()})
    assert target.read_text() == "old\n" and _only(tmp_path) == ["t.md"]


def test_failure_at_rename_or_fsync_keeps_the_old_file(tmp_path, monkeypatch):
    target = write_text_atomic(tmp_path / "t.md", "old\n")

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(target, "new\n")
    assert target.read_text() == "old\n" and _only(tmp_path) == ["t.md"]
    monkeypatch.undo()
    monkeypatch.setattr(atomic.os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        write_bytes_atomic(target, b"new\n")
    assert target.read_text() == "old\n" and _only(tmp_path) == ["t.md"]


def test_keyboard_interrupt_also_cleans_up(tmp_path):
    target = write_text_atomic(tmp_path / "t.md", "old\n")
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(target) as fh:
            fh.write("new")
            raise KeyboardInterrupt
    assert target.read_text() == "old\n" and _only(tmp_path) == ["t.md"]


def test_target_mode_follows_the_umask_like_a_plain_write(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_path = write_text_atomic(tmp_path / "atomic.txt", "x")
    # mkstemp creates 0600 files; a results file must stay readable like one written with open()
    assert oct(atomic_path.stat().st_mode & 0o777) == oct(plain.stat().st_mode & 0o777)


def test_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError):
        with atomic_file(tmp_path / "x", "a"):
            pass
    assert _only(tmp_path) == []


def test_one_table_writer_plain_and_padded():
    assert markdown_table(["a", "b"], [["x", "1"]]).splitlines() == ["| a | b |", "| :--- | ---: |", "| x | 1 |"]
    padded = markdown_table(["T", "tok/s"], [[128, 1.5], [65536, 12345.0]], ["r", "r"], pad=True,
                            cell=lambda c: f"{c:g}").splitlines()
    assert padded == ["|     T | tok/s |", "| ----: | ----: |", "|   128 |   1.5 |", "| 65536 | 12345 |"]
    assert len({len(line) for line in padded}) == 1


def test_results_writer_writes_both_files_atomically(tmp_path):
    js, md = write_results(tmp_path / "out", {"kind": "ppl", "x": float("nan")}, "| a |\n| --- |")
    assert json.loads(js.read_text()) == {"kind": "ppl", "x": "nan"}
    assert md.name == "table.md" and md.read_text() == "| a |\n| --- |\n"
    assert _only(tmp_path / "out") == ["results.json", "table.md"]
    js, md = write_results(tmp_path / "b", {"x": 1}, "# bench\n", markdown_name="results.md", finite=False)
    assert md.name == "results.md" and _only(tmp_path / "b") == ["results.json", "results.md"]
    assert os.path.dirname(js) == str(tmp_path / "b")
