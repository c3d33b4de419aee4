"""Every writer of an output folder takes its lock: eval and bench as convert and train do, so a second
run into the same folder is one ``error:`` line naming the folder and the run that holds it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retrofit.cli.main import main
from retrofit.fs.locks import lock_path
from tests.reliability.test_faults import fails, leftovers

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[2]
_HOLD = "import sys, time\nfrom retrofit.fs.locks import output_lock\n" \
        "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)"


@pytest.fixture
def holder():
    """``holder(folder)``: another process holding ``folder``'s output lock (a run writing it); returns its pid."""
    procs = []

    def hold(folder: Path) -> int:
        proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc.pid

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def _ppl(model, out, *extra) -> list[str]:
    return ["eval", "ppl", str(model), "--lengths", "8", "--datasets", "pg-books", "--max-windows", "1", "--quiet",
            "--out", str(out), *extra]


def test_a_second_eval_into_the_same_folder_is_refused_naming_the_holder(base, tmp_path, capsys, holder):
    out = tmp_path / "results"
    pid = holder(out)
    fails(_ppl(base, out), capsys, str(out), f"being written by pid {pid}")
    fails(_ppl(base, out, "--overwrite"), capsys, str(out), f"pid {pid}")
    fails(["eval", "all", str(base), "--out", str(out), "--skip", "harness"], capsys, str(out), f"pid {pid}")
    assert not out.exists()


def test_eval_holds_the_lock_while_it_writes_and_frees_it(base, tmp_path, capsys, monkeypatch):
    from retrofit.eval import perplexity

    out, seen = tmp_path / "results", []
    real = perplexity.run_perplexity

    def run(*args, **kwargs):  # another process tries the lock while the eval runs
        probe = subprocess.run([sys.executable, "-c", "import sys\nfrom retrofit.fs.locks import LockError, output_lock\n"
                                "try:\n    output_lock(sys.argv[1]).__enter__()\nexcept LockError as e:\n    print(e)",
                                str(out)], capture_output=True, text=True, cwd=REPO)
        seen.append(probe.stdout)
        return real(*args, **kwargs)

    monkeypatch.setattr(perplexity, "run_perplexity", run)
    assert main(_ppl(base, out)) == 0
    assert seen and "being written by pid" in seen[0], seen
    assert (out / "results.json").is_file() and not lock_path(out).exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("suite", ["attention", "decode", "model"])
def test_a_second_bench_into_the_same_folder_is_refused_naming_the_holder(tmp_path, capsys, holder, suite):
    out = tmp_path / "bench"
    pid = holder(out)
    fails(["bench", suite, "--quick", "--out", str(out), "--quiet"], capsys, str(out), f"being written by pid {pid}")
    assert not out.exists()
