"""Hooks of the retrofit_books tasks: the rows are built at load time from the held-out books by
:mod:`retrofit.eval.lastword` (deterministic, offline; nothing is shipped or downloaded).

lm-eval resolves ``!function utils.NAME`` relative to the YAML and calls ``custom_dataset`` with
the task's ``dataset_kwargs`` and metadata.
"""
from __future__ import annotations

from retrofit.eval.lastword import dataset, score_generation

__all__ = ["dataset", "score_generation"]
