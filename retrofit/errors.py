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


def yaml_error_line(exc: BaseException) -> str:
    """A YAML parse error in one line: its problem and where (PyYAML's own text spans several, with a
    caret under the line), so the CLI's message stays one ``error:`` line."""
    problem = str(getattr(exc, "problem", None) or exc).strip().splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def parse_yaml(text: str):
    """``yaml.safe_load(text)``, where every way the text can fail to be a YAML value raises ``yaml.YAMLError``:
    PyYAML lets nesting deeper than Python's recursion limit out as a ``RecursionError`` and an integer of more
    than 4300 digits as a ``ValueError``, which no caller's ``except yaml.YAMLError`` names as bad YAML."""
    import yaml

    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply (lists or mappings inside each other past Python's recursion "
                             "limit)") from None
    except ValueError as exc:  # an integer past Python's int_max_str_digits, and any like it
        raise yaml.YAMLError((str(exc).strip().splitlines() or [type(exc).__name__])[0]) from None
