"""`retrofit eval ... --json`: stdout is exactly the results document (as written to results.json)."""
from __future__ import annotations

import json

from retrofit.cli.main import main


def test_eval_ppl_json(converted_dir, tmp_path, capsys):
    out = tmp_path / "ppl"
    rc = main(["eval", "ppl", str(converted_dir), "--lengths", "64", "--datasets", "pg-books-heldout",
               "--max-windows", "1", "--out", str(out), "-q", "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "results.json").read_text())
    assert printed["results"]["pg-books-heldout"]["64"]["model"]["ppl"] > 1.0
