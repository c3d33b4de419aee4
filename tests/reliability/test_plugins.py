"""A broken plugin never breaks a verb: one that fails to import, registers a clashing evaluator or calls
sys.exit at import is reported in one warning line naming it and skipped; every verb and --help still work."""
from __future__ import annotations

import sys
import textwrap
import warnings
from importlib import metadata

import pytest

from retrofit import plugins
from retrofit.cli.main import main
from retrofit.eval import evaluators as ev_registry

_HEAD = textwrap.dedent("""
    from retrofit.eval.evaluators import Evaluator, register_evaluator

    def run(model, **kwargs):
        return {}

    def add(parser, prefix):
        pass
""")

PLUGINS = {
    # eval's own command that runs every kind
    "plug_all": _HEAD + "register_evaluator(Evaluator(name='plug-all', command='all', subdir='x', heading='X', help='x',"
                        " add_arguments=add, kwargs=lambda a: {}, run=__name__ + ':run'))\n",
    # a flag every eval command has already
    "plug_out": _HEAD.replace("pass", "parser.add_argument('--out')")
                + "register_evaluator(Evaluator(name='plug-out', command='plug-out', subdir='x', heading='X', help='x',"
                  " add_arguments=add, kwargs=lambda a: {}, run=__name__ + ':run'))\n",
    # a flag another kind's command has (eval all holds them both)
    "plug_datasets": _HEAD.replace("pass", "parser.add_argument('--datasets')")
                     + "register_evaluator(Evaluator(name='plug-ds', command='plug-ds', subdir='x', heading='X', "
                       "help='x', add_arguments=add, kwargs=lambda a: {}, run=__name__ + ':run'))\n",
    "plug_exit": "import sys\nsys.exit('this plugin wants out')\n",
    "plug_raise": "raise RuntimeError('broken on purpose')\n",
}


@pytest.fixture
def broken_plugins(tmp_path, monkeypatch):
    """Every module of PLUGINS named in the retrofit.evaluators entry-point group of a fresh process."""
    for name, code in PLUGINS.items():
        (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))

    def entry_points(*, group: str):
        if group != "retrofit.evaluators":
            return []
        return [metadata.EntryPoint(name=name, value=name, group=group) for name in PLUGINS]

    ev_registry._FOUND.everything()
    before = dict(ev_registry._REGISTRY)
    monkeypatch.setattr(plugins.metadata, "entry_points", entry_points)
    monkeypatch.setattr(ev_registry._FOUND, "_done", ev_registry._FOUND._done - {"entry points"})
    yield
    ev_registry._REGISTRY.clear()
    ev_registry._REGISTRY.update(before)
    for name in PLUGINS:
        sys.modules.pop(name, None)


def _reported(caught: list[warnings.WarningMessage]) -> dict[str, int]:
    text = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return {name: sum(name in t for t in text) for name in ("plug_all", "plug-out", "plug-ds", "plug_exit",
                                                           "plug_raise")}


def test_broken_plugins_are_reported_once_and_every_verb_still_works(broken_plugins, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["ls"]) == 0
        with pytest.raises(SystemExit) as done:
            main(["--help"])
        assert done.value.code == 0
        with pytest.raises(SystemExit) as done:
            main(["eval", "--help"])
        assert done.value.code == 0
    out = capsys.readouterr().out
    assert "plug-out" not in out and "plug-ds" not in out and "ppl" in out
    assert _reported(caught) == dict.fromkeys(("plug_all", "plug-out", "plug-ds", "plug_exit", "plug_raise"), 1)
    texts = [str(w.message) for w in caught]
    assert any("plug_exit" in t and "SystemExit" in t and "wants out" in t for t in texts), texts
    assert any("plug-out" in t and "--out" in t for t in texts), texts
    names = [e.name for e in ev_registry.evaluators()]
    assert "perplexity" in names and not {"plug-all", "plug-out", "plug-ds"} & set(names)


def test_convert_runs_beside_broken_plugins(broken_plugins, base, tmp_path):
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert main(["convert", str(base), "--out", str(tmp_path / "out"), "--window", "8", "--latents", "8",
                     "--probe-tokens", "0", "-q"]) == 0
