"""Exceptions with one clear, actionable message each (printed by the CLI without a traceback)."""
from __future__ import annotations


class RetrofitError(Exception):
    """Base class: the message says what went wrong and what to do."""


class UnsupportedModelError(RetrofitError):
    """The model family has no patch in retrofit.patches."""


class SpecError(RetrofitError):
    """A conversion spec, recipe or config key is invalid."""


class CheckpointError(RetrofitError):
    """A checkpoint folder is missing files or does not match its retrofit section."""


class DataError(RetrofitError):
    """Input data is missing or unusable."""


class TrainingError(RetrofitError):
    """Training cannot continue (NaN loss, impossible sequence length, ...)."""
