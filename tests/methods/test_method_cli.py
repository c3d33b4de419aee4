"""`retrofit convert --config <lavo|llp|delta>.yaml` end to end on a tiny base folder (in-process CLI;
the methods are registered by this folder's conftest)."""
from __future__ import annotations

import pytest

import retrofit
from retrofit.cli.main import main as cli_main
from tests.train import tiny


@pytest.mark.parametrize(
    "yaml_text,anchor",
    [
        ("method: lavo\nwindow: 8\noptions:\n  bases: 8\n  global_weight: 0.25\n", True),
        ("method: llp\noptions:\n  segment: 16\n", False),
        ("method: delta\nwindow: 8\noptions:\n  sinks: 2\n  memory_half_life: 64\n", True),
    ],
)
def test_convert_cli_writes_a_loadable_checkpoint(yaml_text, anchor, tmp_path, capsys):
    base = tiny.save_base(tmp_path / "base")
    recipe = tmp_path / "convert.yaml"
    recipe.write_text(yaml_text)
    out = tmp_path / "out"
    code = cli_main(["convert", str(base), "--config", str(recipe), "--out", str(out), "--probe-tokens", "48"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "KL(base || converted)" in printed
    assert ("KL(SWA anchor || converted)" in printed) == anchor  # LAVO's closed path is its SWA anchor
    model = retrofit.load(out)
    assert model.config.retrofit["method"] == recipe.read_text().split()[1]
