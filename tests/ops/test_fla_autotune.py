"""``RETROFIT_FLA_AUTOTUNE=quick``: which autotuning candidates are kept, and that every autotuner
reachable from a module (through Heuristics-like ``.fn`` wrappers) is narrowed. CPU-only: the
objects stand in for Triton's Config / Autotuner / Heuristics by their attributes."""
from __future__ import annotations

import types
from dataclasses import dataclass, field

from retrofit.ops.backends.fla import quick_autotune, quick_configs


@dataclass(frozen=True)
class Cfg:
    kwargs: dict = field(default_factory=dict, hash=False, compare=False)
    num_warps: int = 4
    num_stages: int = 2


def _grid(blocks=(32, 64), warps=(1, 2, 4, 8), stages=(2, 3, 4)):
    return [Cfg({"BK": b}, w, s) for b in blocks for w in warps for s in stages]


def test_quick_keeps_fewest_stages_warps_nearest_four_and_every_block():
    kept = quick_configs(_grid())
    assert {(c.num_warps, c.num_stages) for c in kept} == {(4, 2)}
    assert sorted(c.kwargs["BK"] for c in kept) == [32, 64]


def test_quick_picks_nearest_warps_when_four_is_absent():
    kept = quick_configs(_grid(warps=(1, 8, 16), stages=(3, 4)))
    assert {(c.num_warps, c.num_stages) for c in kept} == {(1, 3)}  # |1-4| = 3 < |8-4|: ties go low
    assert quick_configs([Cfg()]) == [Cfg()] and quick_configs([]) == []


class _Autotuner:
    def __init__(self, configs):
        self.configs, self.keys, self.fn = configs, ["K"], object()


class _Heuristics:
    def __init__(self, fn):
        self.fn, self.values = fn, {}


def test_quick_autotune_narrows_wrapped_and_bare_autotuners_once():
    wrapped, bare = _Autotuner(_grid()), _Autotuner(_grid(blocks=(16,)))
    mod = types.SimpleNamespace(kernel_a=_Heuristics(wrapped), kernel_b=bare, alias=bare, other=[Cfg()], n=3)
    assert quick_autotune([mod]) == 2
    assert len(wrapped.configs) == 2 and len(bare.configs) == 1
    assert mod.other == [Cfg()]  # a plain list of configs is not an autotuner
