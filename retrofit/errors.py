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


_UNIQUE_KEY_LOADER = None


def _unique_key_loader():
    """PyYAML's SafeLoader, except that a mapping that gives one key twice is a ``ConstructorError`` naming the key
    and its line: SafeLoader keeps the last value silently, so a second ``train:`` section replaced the first."""
    global _UNIQUE_KEY_LOADER
    if _UNIQUE_KEY_LOADER is None:
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node, deep=False):
                if isinstance(node, yaml.MappingNode):
                    seen = {}
                    for key_node, _ in node.value:
                        if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' merges, it repeats nothing
                            continue
                        try:
                            key = self.construct_object(key_node, deep=True)
                            hash(key)
                        except Exception:  # an unhashable key: SafeLoader's own error says so
                            continue
                        if key in seen:
                            first, again = seen[key] + 1, key_node.start_mark.line + 1
                            where = f"lines {first} and {again}" if first != again else f"line {first}"
                            exc = yaml.constructor.ConstructorError(
                                None, None, f"key {key!r} is given twice ({where}): give each key once", None)
                            exc.duplicate_key = key  # callers that take bad YAML as a plain string refuse this
                            raise exc
                        seen[key] = key_node.start_mark.line
                return super().construct_mapping(node, deep=deep)

        _UNIQUE_KEY_LOADER = UniqueKeyLoader
    return _UNIQUE_KEY_LOADER


def parse_yaml(text: str):
    """``yaml.safe_load(text)``, where every way the text can fail to be a YAML value raises ``yaml.YAMLError``:
    PyYAML lets nesting deeper than Python's recursion limit out as a ``RecursionError`` and an integer of more
    than 4300 digits as a ``ValueError``, which no caller's ``except yaml.YAMLError`` names as bad YAML. A mapping
    that gives one key twice is bad YAML too (SafeLoader keeps the last value): its error names the key and lines."""
    import yaml

    try:
        return yaml.load(text, Loader=_unique_key_loader())
    except RecursionError:
        raise yaml.YAMLError("nested too deeply (lists or mappings inside each other past Python's recursion "
                             "limit)") from None
    except ValueError as exc:  # an integer past Python's int_max_str_digits, and any like it
        raise yaml.YAMLError((str(exc).strip().splitlines() or [type(exc).__name__])[0]) from None
