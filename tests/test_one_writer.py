"""Every file the toolkit writes goes through its one atomic writer, ``retrofit/fs/atomic.py``.

The shipped source (retrofit/, patches/, eval/ and the scripts/) is read with ``ast`` and every
call that writes a file in place is reported: ``open`` / ``Path.open`` / ``os.fdopen`` and the
compressed-file openers with a write, append, exclusive or update mode (or a mode the scan cannot
read), ``os.open`` with a write flag, ``write_text`` / ``write_bytes`` / ``touch``, and the
writers to a path: ``savefig``, ``torch.save``, safetensors' ``save_file``, numpy's
``save*``, ``save_pretrained``, pandas' ``to_*``, ``shutil`` copies and moves, ``os`` / ``Path``
renames and links. A writer to a path is fine where that path lies in what the atomic writer
handed out: a file handle of ``with atomic_file(...) as fh`` or a folder of
``with atomic_directory(...) as tmp`` (published whole when the block ends). ``ALLOWED`` lists the
few in-place writes that are right as they are, each with its reason.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("retrofit", "patches", "eval", "scripts")
WRITER = "retrofit/fs/atomic.py"

# (file, enclosing function, call): in-place writes that are right as they are. Keep it short and named.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("retrofit/fs/locks.py", "_acquire", "os.open"):
        "opens (or creates) the lock file to flock it: the flock on that open file is the lock itself",
    ("retrofit/fs/tempdirs.py", "settle_swap", "os.rename"):
        "finishes or undoes atomic_directory's swap that a killed writer left: the rename is the publication",
    ("retrofit/bench/common.py", "_reset_hwm", "open"):
        "/proc/self/clear_refs is a kernel control file: writing it resets the peak-memory counter",
    ("retrofit/cli/main.py", "_drop_stdout", "os.open"):
        "opens /dev/null to stand in for a stdout whose reader left the pipe: no file is written",
}

ATOMIC_CONTEXTS = {"atomic_file", "atomic_directory"}  # `with NAME(...) as x`: x is the atomic writer's
FILE_MODULES = {"io", "codecs", "gzip", "bz2", "lzma", "tarfile", "zipfile"}  # MODULE.open(path, mode) is open()
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_APPEND", "O_CREAT", "O_TRUNC"}
# function (full dotted name) -> (position, keyword) of the path it writes
FUNCTION_WRITERS: dict[str, tuple[int, str]] = {
    "torch.save": (1, "f"), "np.save": (0, "file"), "np.savez": (0, "file"), "np.savez_compressed": (0, "file"),
    "np.savetxt": (0, "fname"), "numpy.save": (0, "file"), "numpy.savez": (0, "file"),
    "numpy.savez_compressed": (0, "file"), "numpy.savetxt": (0, "fname"),
    "shutil.copy": (1, "dst"), "shutil.copy2": (1, "dst"), "shutil.copyfile": (1, "dst"),
    "shutil.copytree": (1, "dst"), "shutil.move": (1, "dst"), "os.replace": (1, "dst"), "os.rename": (1, "dst"),
    "os.renames": (1, "new"), "os.link": (1, "dst"), "os.symlink": (1, "dst"),
}
# function or method (last name) -> (position, keyword) of the path it writes
NAMED_WRITERS: dict[str, tuple[int, str]] = {
    "savefig": (0, "fname"), "save_file": (1, "filename"), "save_model": (1, "filename"),
    "save_pretrained": (0, "save_directory"), "to_csv": (0, "path_or_buf"), "to_json": (0, "path_or_buf"),
    "to_parquet": (0, "path"), "tofile": (0, "fid"),
}
RECEIVER_WRITERS = {"write_text", "write_bytes", "touch", "symlink_to", "hardlink_to"}  # path.NAME(...) writes path
PATH_RENAMES = {"rename", "replace"}  # path.NAME(target) writes target


@dataclass(frozen=True)
class Write:
    file: str
    line: int
    function: str
    call: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function}): {self.call}"


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of a Name / Attribute chain; ``?`` stands for anything else (``(p / "x").write_text``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value) or '?'}.{node.attr}"
    return ""


def _arg(call: ast.Call, pos: int, kw: str) -> ast.AST | None:
    for k in call.keywords:
        if k.arg == kw:
            return k.value
    return call.args[pos] if len(call.args) > pos else None


def _writes_mode(mode: ast.AST | None) -> bool:
    """Whether an ``open`` mode writes: any of ``w a x +``, or not a literal the scan can read."""
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True


def _writes_flags(flags: ast.AST | None) -> bool:
    return flags is not None and any(isinstance(n, ast.Attribute) and n.attr in WRITE_FLAGS or
                                     isinstance(n, ast.Name) and n.id in WRITE_FLAGS for n in ast.walk(flags))


class _Scan(ast.NodeVisitor):
    def __init__(self, file: str):
        self.file = file
        self.functions: list[str] = ["<module>"]
        self.atomic: list[set[str]] = [set()]  # names bound to the atomic writer's handles / folders, per with
        self.found: list[Write] = []

    def _inside_atomic(self, dest: ast.AST | None) -> bool:
        names = set().union(*self.atomic)
        return dest is not None and any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(dest))

    def _function(self, node):
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_With(self, node: ast.With) -> None:
        bound = set()
        for item in node.items:
            self.visit(item.context_expr)
            call = item.context_expr
            if isinstance(call, ast.Call) and _dotted(call.func).rsplit(".", 1)[-1] in ATOMIC_CONTEXTS \
                    and isinstance(item.optional_vars, ast.Name):
                bound.add(item.optional_vars.id)
        self.atomic.append(bound)
        for stmt in node.body:
            self.visit(stmt)
        self.atomic.pop()

    visit_AsyncWith = visit_With

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        name = _dotted(node.func)
        leaf = name.rsplit(".", 1)[-1]
        receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
        if name in ("open", "io.open", "os.fdopen", "zipfile.ZipFile", "ZipFile") or \
                (leaf == "open" and name.split(".")[0] in FILE_MODULES):
            hit = _writes_mode(_arg(node, 1, "mode")) and not self._inside_atomic(_arg(node, 0, "file"))
        elif name == "os.open":
            hit = _writes_flags(_arg(node, 1, "flags")) and not self._inside_atomic(_arg(node, 0, "path"))
        elif name in FUNCTION_WRITERS:
            hit = not self._inside_atomic(_arg(node, *FUNCTION_WRITERS[name]))
        elif leaf in NAMED_WRITERS:
            hit = not self._inside_atomic(_arg(node, *NAMED_WRITERS[leaf]))
        elif receiver is None:
            hit = False
        elif leaf == "open":  # Path.open(mode)
            hit = _writes_mode(_arg(node, 0, "mode")) and not self._inside_atomic(receiver)
        elif leaf in RECEIVER_WRITERS:
            hit = not self._inside_atomic(receiver)
        elif leaf in PATH_RENAMES and name != "dataclasses.replace":  # path.rename(target); str.replace takes two
            hit = len(node.args) == 1 and not node.keywords and not self._inside_atomic(node.args[0])
        else:
            hit = False
        if hit:
            self.found.append(Write(self.file, node.lineno, self.functions[-1], name))


def scan_source(source: str, file: str = "<string>") -> list[Write]:
    """The in-place writes in ``source`` (nothing is allowed here: see :func:`scan`)."""
    visitor = _Scan(file)
    visitor.visit(ast.parse(source))
    return visitor.found


def scan(root: Path = ROOT) -> list[Write]:
    """Every in-place write under ``root``'s scanned folders, outside the atomic writer, allow-list included."""
    found = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel != WRITER:
                found += scan_source(path.read_text(encoding="utf-8"), rel)
    return found


def _allowed(w: Write) -> bool:
    return (w.file, w.function, w.call) in ALLOWED


def test_no_shipped_code_writes_a_file_in_place():
    bad = [str(w) for w in scan() if not _allowed(w)]
    assert not bad, ("these write a file in place; use retrofit.fs.atomic (write_text_atomic, write_json_atomic, "
                     "atomic_file, save_figure_atomic, atomic_directory, AppendLog) instead:\n  " + "\n  ".join(bad))


def test_every_allow_list_entry_still_names_a_write():
    live = {(w.file, w.function, w.call) for w in scan()}
    assert set(ALLOWED) <= live, f"stale ALLOWED entries (remove them): {sorted(set(ALLOWED) - live)}"
    assert all(len(reason) > 20 for reason in ALLOWED.values())


PLANTED = {
    "open for writing": "def f(p):\n    with open(p, 'w') as fh:\n        fh.write('x')\n",
    "open for appending": "def f(p):\n    open(p, mode='a').write('x')\n",
    "open for update": "def f(p):\n    open(p, 'r+b')\n",
    "open with a mode read at run time": "def f(p, m):\n    open(p, m)\n",
    "Path.open for writing": "def f(p):\n    p.open('wb')\n",
    "gzip open for writing": "import gzip\ndef f(p):\n    gzip.open(p, 'wt')\n",
    "os.open with a write flag": "import os\ndef f(p):\n    os.open(p, os.O_WRONLY | os.O_CREAT)\n",
    "os.fdopen for writing": "import os\ndef f(fd):\n    os.fdopen(fd, 'w')\n",
    "write_text": "def f(p):\n    (p / 'report.md').write_text('x')\n",
    "write_bytes": "def f(p):\n    p.write_bytes(b'x')\n",
    "savefig to a path": "def f(fig, p):\n    fig.savefig(p, dpi=120)\n",
    "torch.save to a path": "import torch\ndef f(sd, p):\n    torch.save(sd, p / 'w.pt')\n",
    "safetensors save_file": "from safetensors.torch import save_file\ndef f(sd, p):\n    save_file(sd, str(p))\n",
    "numpy savez": "import numpy as np\ndef f(a, p):\n    np.savez(p, a=a)\n",
    "save_pretrained in place": "def f(model, out):\n    model.save_pretrained(out)\n",
    "shutil.copy": "import shutil\ndef f(a, b):\n    shutil.copy(a, b)\n",
    "os.replace": "import os\ndef f(a, b):\n    os.replace(a, b)\n",
    "Path.rename": "def f(a, b):\n    a.rename(b)\n",
    "a write beside, not inside, an atomic folder": (
        "def f(out, m):\n    with atomic_directory(out) as tmp:\n        m.save_pretrained(out)\n"),
    "a write after the atomic block ended": (
        "def f(p, fig):\n    with atomic_file(p, 'wb') as fh:\n        pass\n    fig.savefig(p)\n"),
}

NOT_WRITES = {
    "open for reading": "def f(p):\n    open(p).read(); open(p, 'rb'); p.open(encoding='utf-8'); p.open('r')\n",
    "os.open read-only": "import os\ndef f(p):\n    os.open(p, os.O_RDONLY)\n",
    "a figure into the atomic writer's handle": (
        "def f(fig, p):\n    with atomic_file(p, 'wb') as fh:\n        fig.savefig(fh, format='png')\n"),
    "numpy into the atomic writer's handle": (
        "import numpy as np\ndef f(a, p):\n    with atomic_file(p, 'wb') as fh:\n        np.savez(fh, a=a)\n"),
    "files inside an atomic folder": (
        "def f(m, out):\n    with atomic_directory(out, overwrite=True) as tmp:\n        m.save_pretrained(tmp)\n"
        "        (tmp / 'README.md').write_text('x')\n        save_file({}, str(tmp / 'w.safetensors'))\n"),
    "a string's replace": "def f(s):\n    return s.replace('a', 'b')\n",
    "a dataclass's replace": "import dataclasses\ndef f(spec):\n    return dataclasses.replace(spec)\n",
}


@pytest.mark.parametrize("what", sorted(PLANTED))
def test_the_scan_finds_a_planted_in_place_write(what):
    found = scan_source(PLANTED[what])
    assert len(found) == 1, (what, found)


@pytest.mark.parametrize("what", sorted(NOT_WRITES))
def test_the_scan_passes_reads_and_writes_through_the_atomic_writer(what):
    assert scan_source(NOT_WRITES[what]) == []


def test_a_violation_planted_in_the_tree_fails_the_scan(tmp_path):
    for folder in SCANNED:
        (tmp_path / folder).mkdir()
    (tmp_path / "retrofit" / "fs").mkdir()
    (tmp_path / WRITER).write_text(PLANTED["open for writing"])  # the writer itself may write in place
    (tmp_path / "eval" / "report.py").write_text("import json\n" + PLANTED["write_text"])
    found = scan(tmp_path)
    assert [(w.file, w.line, w.function, w.call) for w in found] == [("eval/report.py", 3, "f", "?.write_text")]
    assert not _allowed(found[0])
