"""The keyword arguments every evaluator's run function takes alike.

``run_perplexity``, ``run_passkey``, ``run_ruler`` and ``run_niah`` each take the model's
tokenizer and a baseline (with its tokenizer), load them on one device in one dtype with one RoPE cap, write their files to one folder, show or
hide one progress bar and record the command line that ran them. Those keywords are declared
here once, as :class:`RunOptions`, and a run function takes them as ``**options``::

    def run_x(model, *, lengths=..., zero_shot=(), **options: Any) -> dict:
        opts = run_options("run_x", options)  # opts.baseline, opts.device, opts.out, ...

``zero_shot`` stays in each signature: whether an evaluator scores zero-shot variants is read
from its signature (:func:`retrofit.eval.variants.takes_zero_shot`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from retrofit.eval import report, variants


class RunOptions(NamedTuple):
    """The shared keywords of an evaluator's run function, with their defaults.

    tokenizer: the model's, when the model is passed loaded (None: loaded with it from its name or
    path). baseline / baseline_tokenizer: the model scored beside it, the same ways (None: none).
    device: where the models run (``cpu``, ``cuda``, ``cuda:1``, ...). dtype: the weights' dtype
    (None: as loaded). rope_cap: cap the RoPE distance of the full-attention layers at this many
    tokens (:func:`retrofit.surgery.rope_cap.cap_rope`; 0 removes a converted model's cap; None: as
    loaded). out: the folder for results.json, table.md and the plot (None: write nothing).
    progress: show a progress bar. command: the command line recorded in the results (None: none).
    """

    tokenizer: Any = None
    baseline: Any = None
    baseline_tokenizer: Any = None
    device: str = "cpu"
    dtype: str | None = None
    rope_cap: int | None = None
    out: str | Path | None = None
    progress: bool = True
    command: str | None = None

    def roles(self, model: Any, zero_shot: list[str] | tuple[str, ...]) -> dict[str, tuple[Any, Any, str]]:
        """``{role: (model, tokenizer, label)}`` for ``model``, the baseline and the ``zero_shot``
        variants, loaded on this device, dtype and RoPE cap (:func:`retrofit.eval.variants.resolve_roles`)."""
        return variants.resolve_roles(model, self.tokenizer, self.baseline, self.baseline_tokenizer,
                                      variants=variants.parse_variants(zero_shot), device=self.device,
                                      dtype=self.dtype, rope_cap=self.rope_cap)

    def finish(self, res: dict, *, description: str, table: Callable[[dict], str],
               plot: Callable[[dict, Path], Path | None], image: str) -> dict:
        """A run's results dict completed: the command line (if any), ``description``, the markdown
        ``table(res)``; with ``out``, written there with ``plot``'s image (:func:`retrofit.eval.report.finish_results`)."""
        if self.command:
            res["command"] = self.command
        res["description"] = description
        res["table"] = table(res)
        return report.finish_results(res, self.out, plot, image)


def run_options(function: str, options: Mapping[str, Any]) -> RunOptions:
    """``options`` (a run function's ``**options``) as :class:`RunOptions`, defaults filled in.

    A keyword that is not one of them is a TypeError worded as Python words it for a named
    parameter: ``function() got an unexpected keyword argument 'name'``.
    """
    for name in options:
        if name not in RunOptions._fields:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    return RunOptions(**options)
