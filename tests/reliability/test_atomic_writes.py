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


# ---------------------------------------------------------------------- append-only logs
def test_append_log_adds_whole_records_and_a_torn_one_is_no_record(tmp_path):
    log = atomic.AppendLog(tmp_path / "m.jsonl")
    assert log.records() == [] and log.retain(lambda line: True) == 0 and _only(tmp_path) == []
    log.append('{"step": 1}')
    log.append('{"step": 2}')
    with open(log.path, "ab") as fh:  # a writer killed mid-record
        fh.write(b'{"step": 3, "lo')
    assert log.records() == ['{"step": 1}', '{"step": 2}']
    assert log.retain(lambda line: True) == 1  # the torn record goes, the whole ones stay
    assert log.path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    assert log.retain(lambda line: "1" in line) == 1 and log.records() == ['{"step": 1}']
    log.sync()
    with pytest.raises(ValueError):
        log.append("two\nrecords")
    assert log.records() == ['{"step": 1}'] and _only(tmp_path) == ["m.jsonl"]


def test_a_failed_append_leaves_no_half_record(tmp_path, monkeypatch):
    log = atomic.AppendLog(tmp_path / "m.jsonl")
    log.append("first")
    real = os.write

    def half_then_full(fd, data):  # the disk fills after part of the record
        real(fd, data[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space"):
        log.append("second record")
    monkeypatch.undo()
    assert log.path.read_bytes() == b"first\n"
    log.append("third")
    assert log.records() == ["first", "third"]


def test_a_failed_retain_keeps_every_record(tmp_path, monkeypatch):
    log = atomic.AppendLog(tmp_path / "m.jsonl")
    for i in range(3):
        log.append(str(i))
    monkeypatch.setattr(atomic.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        log.retain(lambda line: line == "0")
    assert log.records() == ["0", "1", "2"] and _only(tmp_path) == ["m.jsonl"]


# ---------------------------------------------------------------------- removing a folder
def test_remove_directory_leaves_nothing_and_a_killed_removal_is_cleaned_later(tmp_path, monkeypatch):
    from retrofit.fs import clean_stale_temps

    folder = tmp_path / "checkpoint-3"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "w.bin").write_bytes(b"x")
    atomic.remove_directory(folder)
    atomic.remove_directory(folder)  # gone already: nothing to do
    assert _only(tmp_path) == []
    (folder / "sub").mkdir(parents=True)
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda *a, **k: None)  # killed after the rename
    atomic.remove_directory(folder)
    monkeypatch.undo()
    (trash,) = tmp_path.iterdir()
    assert trash.name.startswith(".checkpoint-3.trash-") and not folder.exists()
    assert clean_stale_temps(tmp_path) == []  # its writer (this process) is alive: kept
    dead = trash.with_name(trash.name.replace(f"-{os.getpid()}-", "-999999999-"))
    trash.rename(dead)
    assert clean_stale_temps(tmp_path) == [dead] and _only(tmp_path) == []


def test_symlink_atomic_replaces_a_link_and_never_a_folder(tmp_path):
    from retrofit.fs.atomic import symlink_atomic

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = symlink_atomic(tmp_path / "final", "a")
    assert link.is_symlink() and link.resolve() == (tmp_path / "a").resolve() and os.readlink(link) == "a"
    symlink_atomic(tmp_path / "final", "b")  # replaced in one rename
    assert link.resolve() == (tmp_path / "b").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "final"]  # no temporary left
    with pytest.raises(FileExistsError):
        symlink_atomic(tmp_path / "a", "b")
    assert (tmp_path / "a").is_dir() and not (tmp_path / "a").is_symlink()


def test_write_failure_knows_the_full_disk_of_torch_and_safetensors_and_nothing_else():
    from safetensors import SafetensorError

    from retrofit.fs.write_errors import write_failure

    old = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')  # safetensors < 0.6
    new = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_failure(old) == "writing a safetensors file failed (No space left on device)"
    assert write_failure(new) == "writing a safetensors file failed (No space left on device (os error 28))"
    assert "write failed" in write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9"))
    assert "write failed" in write_failure(RuntimeError("PytorchStreamWriter failed writing file data/0"))
    for other in (SafetensorError("Error while deserializing header: HeaderTooLarge"), RuntimeError("shape mismatch"),
                  OSError(28, "No space left on device"), ValueError("inline_container")):
        assert write_failure(other) is None


def test_atomic_directory_turns_a_failed_safetensors_write_into_one_error_and_leaves_nothing(tmp_path):
    from safetensors import SafetensorError

    from retrofit.errors import CheckpointError

    with pytest.raises(CheckpointError, match="cannot write .*out: writing a safetensors file failed.*nothing was written"):
        with atomic.atomic_directory(tmp_path / "out") as tmp:
            (tmp / "model.safetensors").write_bytes(b"partial")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert _only(tmp_path) == []
    with pytest.raises(ValueError, match="not a write"):  # any other error passes through unchanged
        with atomic.atomic_directory(tmp_path / "out"):
            raise ValueError("not a write")
    assert _only(tmp_path) == []
