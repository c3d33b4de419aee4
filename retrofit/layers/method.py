"""A conversion method as one unit: its config dataclass, its builder and its registration.

Each method module (``retrofit/layers/<method>.py``) defines

* a :class:`MethodConfig` subclass: the method's own hyper-parameters, each default written
  once as a dataclass default, with ``help`` in the field metadata (the ``retrofit convert``
  flags and the recipe's ``conversion:`` keys are derived from these fields), and the
  training behaviours the method takes part in (``capabilities``, e.g. ``"window_dropout"``),
* its layer (a ``RetrofitAttention`` writing ``attend``), its decoding-cache entry, and a builder
  ``builder(original, patch, spec, layer_idx, generator) -> layer`` that reads ``spec.config``,
* one ``register_method(name, builder, config=TheConfig, description=...)`` call,
* its config's ``test_spec``, a :class:`MethodTestSpec`: the options that make the method meaningful
  on a tiny test model, its exactness anchor and the generic checks it cannot take, with why
  (data read by ``tests/methods/test_every_method.py``, which runs every registered method).

``retrofit/layers/__init__.py`` imports the built-in method modules, which registers them, on
first use of the registry; a method defined anywhere else registers itself the same way when its
module is imported, or through the ``retrofit.methods`` entry-point group (the rule every
registry follows: :mod:`retrofit.plugins`, ``docs/extending.md``). This module needs no torch:
it only holds data and the registry.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from retrofit.errors import SpecError
from retrofit.plugins import Discovery, check_name

__all__ = [
    "DEFAULT_WINDOW", "MethodConfig", "MethodInfo", "MethodTestSpec", "TEST_ANCHORS", "TEST_CHECKS",
    "available_methods", "check_chunk_size", "chunk_size_opt", "get_method", "method_fields", "register_method",
    "registered_method", "resolve_window",
]

# The sliding window of a converted layer unless the spec names one (the paper's w = 128); with
# ``layers: global`` the family's native window (Gemma 3: 512) is the default instead. Every
# windowed method (macchiato, lavo) and the benchmarks read this one constant.
DEFAULT_WINDOW = 128

Builder = Callable[..., Any]


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its default and its help text (shown by ``retrofit convert --help``)."""
    return field(default=default, metadata={"help": help, **kw})


def chunk_size_opt(default: int = 64) -> Any:
    """A method's ``chunk_size`` field: the chunk length of its chunkwise-parallel scan (checked by
    :func:`check_chunk_size`)."""
    return opt(default, "chunk length of the chunkwise-parallel scan over the new state")


def check_chunk_size(chunk_size: int) -> None:
    """``SpecError`` unless a method's scan chunk ``chunk_size`` is at least one token."""
    if chunk_size < 1:
        raise SpecError(f"chunk_size must be >= 1, got {chunk_size}")


# ---------------------------------------------------------------------- test spec
# The exactness anchors a method may declare (MethodTestSpec.anchor):
# "closed-window": with the new path closed (``retrofit.surgery.probe.closed_latent_path``, the eval's
#     ``closed`` variant) the converted model is the pretrained one attending to the last ``window``
#     tokens plus the first ``sinks`` (its test options' values; 0 sinks without the option),
#     whatever its new weights hold;
# "segment-mask": the converted model is the pretrained one under LLP's mask: a query sees its own
#     half-segment of ``segment / 2`` tokens and the previous one.
TEST_ANCHORS = ("closed-window", "segment-mask")
# The generic checks every method takes (MethodTestSpec.lacks names those it cannot take).
TEST_CHECKS = ("convert", "anchor", "checkpoint", "delta_checkpoint", "hf_load", "decode", "perplexity", "generate")


@dataclass(frozen=True)
class MethodTestSpec:
    """How the generic method tests run a method on a tiny model (two layers, hidden 64, four query
    heads, sequences of tens of tokens): data only, declared as the config's ``test_spec``.

    ``options``: conversion keys (the config's fields) that make the method meaningful at that size,
    e.g. ``{"window": 6, "sinks": 2}`` (the default window of 128 would be full attention there).
    ``anchor``: the exactness property the method has, one of :data:`TEST_ANCHORS` (None: none).
    ``lacks``: ``{check: why}`` for the checks of :data:`TEST_CHECKS` the method genuinely cannot
    take (e.g. ``{"decode": "no cache step"}``, or ``{"anchor": ...}`` beside ``anchor=None``); the
    tests skip those with the reason. A config class that declares no ``test_spec`` of its own (one
    inherited from a parent config does not count) is tested with its defaults and no anchor.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    anchor: str | None = None
    lacks: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.anchor is not None and self.anchor not in TEST_ANCHORS:
            raise ValueError(f"test_spec anchor {self.anchor!r}: use one of {', '.join(TEST_ANCHORS)} or None")
        unknown = sorted(set(self.lacks) - set(TEST_CHECKS))
        if unknown:
            raise ValueError(f"test_spec lacks unknown check(s) {unknown}; the checks: {', '.join(TEST_CHECKS)}")
        if self.anchor is not None and "anchor" in self.lacks:
            raise ValueError("test_spec declares an anchor and lacks one")


@dataclass
class MethodConfig:
    """Base of every method's config. Fields are checked against their annotations on creation
    (``SpecError`` naming the field); subclasses add range checks in :meth:`check`."""

    method: ClassVar[str] = ""
    # Method-specific training behaviours the method takes part in, read generically by
    # retrofit.train (never by testing the method's name). Known ones:
    # "window_dropout": its layers have a sliding-window branch that ``train.window_dropout`` drops
    # for whole sequences (the layer sets p(window) = 0 while ``window_dropout`` > 0 in training).
    # "fit": ``retrofit fit`` (retrofit.train.fit) fits its layers' read to the base's attention, layer
    # by layer (the layers provide read_kl, scale_regression and the fitted weights it names: Hedgehog's).
    capabilities: ClassVar[frozenset[str]] = frozenset()
    # How the generic method tests run this method on a tiny model (MethodTestSpec above).
    test_spec: ClassVar[MethodTestSpec | None] = None

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), hints.get(f.name, Any)))
        self.check()

    def check(self) -> None:
        """Range checks beyond the types (raise ``SpecError`` with what to use instead)."""

    def check_capability(self, capability: str) -> None:
        """Raise ``SpecError`` unless this config can take part in ``capability`` (one of
        :attr:`capabilities`); subclasses add the reasons a declared one cannot apply."""
        if capability not in self.capabilities:
            raise SpecError(f"method {self.method!r} has no {capability} (its capabilities: "
                            f"{', '.join(sorted(self.capabilities)) or 'none'})")

    def resolved(self, model_config: Any, layers: Any) -> "MethodConfig":
        """A copy with model-dependent defaults made concrete (what a checkpoint records)."""
        return dataclasses.replace(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.to_dict().items())


def _type_args(tp: Any) -> tuple[Any, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` (int, float, bool, str, ``X | None``)."""
    allowed = _type_args(tp)
    if value is None:
        if type(None) in allowed or Any in allowed:
            return None
        raise SpecError(f"{name} must be set (got null)")
    if Any in allowed:
        return value
    if bool in allowed and isinstance(value, bool):
        return value
    if int in allowed and isinstance(value, int) and not isinstance(value, bool):
        return value
    if float in allowed and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if str in allowed and isinstance(value, str):
        return value
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    want = " or ".join(kinds.get(t, getattr(t, "__name__", str(t))) for t in allowed if t is not type(None))
    raise SpecError(f"{name} must be {want}{' (or null)' if type(None) in allowed else ''}, got {value!r}")


def resolve_window(window: int | None, model_config: Any, layers: Any) -> int:
    """``window`` as converted: the given one, else the native window under ``layers: global``,
    else :data:`DEFAULT_WINDOW`."""
    if window is not None:
        return int(window)
    native = getattr(model_config, "sliding_window", None) if layers == "global" else None
    return int(native) if native else DEFAULT_WINDOW


def method_fields(config_cls: type[MethodConfig]) -> list[tuple[dataclasses.Field, Any]]:
    """``(field, annotation)`` of a config class, in declaration order."""
    hints = typing.get_type_hints(config_cls)
    return [(f, hints.get(f.name, Any)) for f in dataclasses.fields(config_cls)]


# ---------------------------------------------------------------------- registry
@dataclass(frozen=True)
class MethodInfo:
    name: str
    builder: Builder
    config: type[MethodConfig]
    description: str = ""

    @property
    def uses(self) -> tuple[str, ...]:
        """The method's own spec keys (its config's fields)."""
        return self.config.field_names()

    @property
    def test_spec(self) -> MethodTestSpec:
        """The :class:`MethodTestSpec` the config class itself declares, or the defaults' (no options,
        no anchor). Not inherited: a config subclassing another method's has its own builder, which
        may not read the options that method's spec sets."""
        return vars(self.config).get("test_spec") or MethodTestSpec()


_METHODS: dict[str, MethodInfo] = {}


def _import_builtins() -> None:
    import retrofit.layers  # noqa: F401  (importing the package imports, i.e. registers, each method module)


_FOUND = Discovery("retrofit.methods", _import_builtins)


def register_method(
    name: str,
    builder: Builder,
    *,
    config: type[MethodConfig] | None = None,
    options: Mapping[str, Any] | None = None,
    description: str = "",
    replace: bool = False,
) -> MethodInfo:
    """Register a conversion method under ``name`` (``--method name``, ``method: name``).

    ``config``: the method's :class:`MethodConfig` subclass. ``options`` (``{key: default}``) is
    the short form for a method without its own class: a config class with those fields is made.
    A name already registered (a built-in's included) is a ``RetrofitError`` unless ``replace=True``
    (the rule of every registry: :mod:`retrofit.plugins`).
    """
    _FOUND.builtins()
    if config is None:
        config = _config_from_options(name, dict(options or {}))
    elif options:
        raise ValueError("register_method: give config= or options=, not both")
    if not (isinstance(config, type) and issubclass(config, MethodConfig)):
        raise TypeError(f"config must be a MethodConfig subclass, got {config!r}")
    clash = set(config.field_names()) & set(COMMON_KEYS)
    if clash:
        raise ValueError(f"method {name!r}: config field(s) {sorted(clash)} clash with the common spec keys")
    info = MethodInfo(name, builder, config, description)
    check_name("method", name, _METHODS.get(name), info, replace=replace)
    _METHODS[name] = info
    return info


# keys of ConversionSpec itself, which no method config may reuse
COMMON_KEYS = ("method", "layers", "dtype", "seed", "rope_cap")


def _config_from_options(name: str, options: dict[str, Any]) -> type[MethodConfig]:
    fields = [(k, Any, field(default=v, metadata={"help": f"{name} option"})) for k, v in options.items()]
    cls = dataclasses.make_dataclass(f"{name.title().replace('-', '')}Config", fields, bases=(MethodConfig,))
    cls.method = name
    return cls


def available_methods() -> list[str]:
    _FOUND.everything()
    return sorted(_METHODS)


def registered_method(name: str) -> MethodInfo | None:
    """The method registered under ``name``, or None (no error: layers of unregistered toy classes)."""
    _FOUND.everything()
    return _METHODS.get(name)


def get_method(name: str) -> MethodInfo:
    _FOUND.everything()
    if name not in _METHODS:
        raise SpecError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    return _METHODS[name]
