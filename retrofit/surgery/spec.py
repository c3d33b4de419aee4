"""``ConversionSpec``: what to convert and how, from Python, CLI flags or a YAML recipe.

A spec is the common keys (``method``, ``layers``, ``dtype``, ``seed``) plus the chosen
method's config (``spec.config``, a :class:`retrofit.layers.method.MethodConfig` dataclass that
lives with the method's layer: ``MacchiatoConfig``, ``ExpLinearConfig``, ``LavoConfig``,
``LLPConfig``, or a registered method's own). Every key of a recipe, a record and the
``retrofit convert`` flags is one of these fields, so each default is written once, in the
method's config; a key the chosen method does not have is an error.

YAML (``configs/convert-*.yaml``) is a flat mapping, or a mapping with a ``convert:`` section
holding it (so training recipes can embed the conversion)::

    method: macchiato
    window: 128           # default: 128, or the family's native window with layers: global
    latents: 128          # total over query heads (L); L / Hq latents per head
    init_swa_share: 0.9   # initial p(0|t), the sliding-window share
    conv_size: 0          # >1 adds a causal depthwise conv before the latent projections
    sinks: 0              # attention sinks: the window branch also sees the first n tokens
    layers: all           # "global" (a hybrid model's full-attention layers), indices, or "0-5,8"
    rope_cap: 32767       # RoPE distance cap of the layers left as full attention (ReRoPE-style;
                          # default the base's max_position_embeddings - 1; 0 = none)

Method keys may also sit under ``options:`` in a recipe. A checkpoint's record (the spec's flat
keys plus ``toolkit_version``, ``base_model``, ``converted_layers``) loads through
:meth:`ConversionSpec.from_dict` with ``allow_record_keys=True``; a record carrying ``options``
was written by a pre-release retrofit and is refused with a ``SpecError`` (convert again).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from retrofit.errors import SpecError, parse_yaml

__all__ = ["ConversionSpec", "DEFAULT_INIT_SWA_SHARE", "DEFAULT_WINDOW", "DTYPES", "global_layers", "parse_layers"]

LAYER_KEYWORDS = ("all", "global")

DTYPES = ("float32", "bfloat16", "float16")
MAX_SIZE = 2**31 - 1  # the largest window / latent count / token distance a spec takes: torch indexes in int64,
# but sizes past int32 overflow kernels and cache shapes long before (an absurd value fails here, not in generate)
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
# keys a checkpoint's record carries besides the spec fields
RECORD_KEYS = ("toolkit_version", "base_model", "converted_layers")
# no model has this many layers: indices are checked against it before a range is expanded
# (the model's own count is checked by validate_for)
MAX_LAYER_INDEX = 4095


def __getattr__(name: str) -> Any:
    """``DEFAULT_WINDOW`` / ``DEFAULT_INIT_SWA_SHARE`` are the methods' constants, read on demand so
    that importing this module imports no layer (torch)."""
    if name == "DEFAULT_WINDOW":
        from retrofit.layers.method import DEFAULT_WINDOW

        return DEFAULT_WINDOW
    if name == "DEFAULT_INIT_SWA_SHARE":
        from retrofit.layers.macchiato import DEFAULT_INIT_SWA_SHARE

        return DEFAULT_INIT_SWA_SHARE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_layers(value: Any) -> str | list[int]:
    """``"all"``, ``"global"``, a list of ints, or ``"0-3,6"`` -> a keyword or a sorted list.

    ``global`` names a hybrid model's full-attention layers (``config.layer_types``); it is
    resolved against the model by :func:`global_layers` at conversion.
    """
    if value is None:
        return "all"
    if isinstance(value, str) and value.strip().lower() in LAYER_KEYWORDS:
        return value.strip().lower()
    items: list[int] = []
    if isinstance(value, str):
        for part in value.replace(" ", "").split(","):
            if not part:
                continue
            try:
                if "-" in part:
                    lo, hi = part.split("-", 1)
                    lo, hi = int(lo), int(hi)
                    if hi > MAX_LAYER_INDEX:
                        raise SpecError(f"layers: index {hi} in {part!r} is beyond any model (at most "
                                        f"{MAX_LAYER_INDEX}); give indices below the model's layer count")
                    items.extend(range(lo, hi + 1))
                else:
                    items.append(int(part))
            except (TypeError, ValueError):
                raise SpecError(f"layers: cannot parse {value!r}; use 'all', '0,2,4' or '0-5'") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(f"layers: expected integer layer indices, got {v!r}")
            items.append(v)
    else:
        raise SpecError(f"layers: expected 'all' or a list of layer indices, got {value!r}")
    if not items:
        raise SpecError("layers: empty selection; use 'all' or list at least one layer index")
    if any(i < 0 for i in items):
        raise SpecError(f"layers: indices must be >= 0, got {value!r}")
    if any(i > MAX_LAYER_INDEX for i in items):
        raise SpecError(f"layers: index {max(items)} is beyond any model (at most {MAX_LAYER_INDEX}); "
                        "give indices below the model's layer count")
    return sorted(set(items))


def global_layers(config: Any) -> list[int]:
    """Indices of the full-attention layers of a hybrid model (``config.layer_types``).

    Raises ``SpecError`` for a model without ``layer_types`` or without native sliding-window
    layers: ``layers: global`` only makes sense where some layers already are windowed.
    """
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not types:
        raise SpecError(f"layers: global needs a hybrid model with config.layer_types (Gemma 2/3, or Qwen2/Mistral "
                        f"with sliding layers); {getattr(config, 'model_type', 'this model')} has none: use 'all' "
                        "or layer indices")
    if window is None or "sliding_attention" not in types:
        raise SpecError(f"layers: global: every layer of this {getattr(config, 'model_type', '')} model is full "
                        "attention (no native sliding-window layers); use 'all' or layer indices")
    return [i for i, t in enumerate(types) if t != "sliding_attention"]


COMMON_KEYS = ("method", "layers", "dtype", "seed", "rope_cap")


def _method(name: Any):
    from retrofit.layers.method import get_method  # imports (registers) the method modules once

    if not isinstance(name, str):
        raise SpecError(f"method must be a name (string), got {name!r}")
    return get_method(name)


def _all_method_keys() -> dict[str, list[str]]:
    """key -> the registered methods that have it."""
    from retrofit.layers.method import available_methods, get_method

    keys: dict[str, list[str]] = {}
    for m in available_methods():
        for k in get_method(m).config.field_names():
            keys.setdefault(k, []).append(m)
    return keys


@dataclass(init=False)
class ConversionSpec:
    """How to convert a model: the common keys + ``config``, the method's own config dataclass.

    ``ConversionSpec(method="lavo", window=64, bases=32)``: keywords other than the common ones
    are the method's config fields (``options={...}`` is accepted too, the older spelling).
    The method's fields read as attributes (``spec.window``). Validated on construction
    (``SpecError`` with what to fix). A ``config`` of another method (``dataclasses.replace(spec,
    method=...)``) is dropped: the new method starts from its own defaults.
    """

    DEFAULT_METHOD: ClassVar[str] = "macchiato"

    method: str
    layers: str | list[int]
    dtype: str | None
    seed: int
    rope_cap: int | None  # RoPE distance cap of the layers left as full attention (None: the base's context)
    config: Any  # the method's MethodConfig

    def __init__(
        self,
        method: str | None = None,
        layers: str | list[int] | None = "all",
        dtype: str | None = None,
        seed: int = 0,
        config: Any = None,
        rope_cap: int | None = None,
        *,
        options: Mapping[str, Any] | None = None,
        **method_keys: Any,
    ) -> None:
        method = self.DEFAULT_METHOD if method is None else method
        info = _method(method)
        cls = info.config
        if options is not None and not isinstance(options, Mapping):
            raise SpecError(f"options must be a mapping, got {options!r}")
        unknown = set(options or {}) - set(cls.field_names())
        if unknown:
            allowed = ", ".join(cls.field_names()) or "none"
            raise SpecError(f"method {method!r} has no option(s) {', '.join(sorted(unknown))}; allowed: {allowed}")
        _check_keys(method, cls, method_keys)
        if isinstance(config, Mapping):
            _check_keys(method, cls, config)
            base = dict(config)
        elif isinstance(config, cls):
            base = config.to_dict()
        else:
            base = {}  # None, or another method's config (a method change through dataclasses.replace)
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "rope_cap", rope_cap)
        object.__setattr__(self, "config", cls(**{**base, **dict(options or {}), **method_keys}))
        self.validate()

    # ------------------------------------------------------------------ the method's fields as attributes
    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and not name.startswith("__") and name in config.field_names():
            return getattr(config, name)
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}"
            + (f" (method {self.__dict__.get('method')!r} has no such key)" if config is not None else "")
        )

    def __setattr__(self, name: str, value: Any) -> None:
        config = self.__dict__.get("config")
        if config is not None and name in config.field_names():
            object.__setattr__(self, "config", dataclasses.replace(config, **{name: value}))
        else:
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ConversionSpec":
        info = _method(self.method)
        if not isinstance(self.config, info.config):
            raise SpecError(f"config must be a {info.config.__name__} for method {self.method!r}, "
                            f"got {type(self.config).__name__}")
        self.config = info.config(**self.config.to_dict())  # re-checked (fields may have been assigned)
        for key, value in {**self.config.to_dict(), "rope_cap": self.rope_cap}.items():
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SIZE:
                raise SpecError(f"{key}={value} is beyond any model (at most {MAX_SIZE}): give a size the model "
                                "can hold, e.g. a window or latent count of a few thousand")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SpecError(f"seed must be an integer, got {self.seed!r}")
        if not -(2**63) <= self.seed < 2**64:  # what torch.manual_seed takes
            raise SpecError(f"seed={self.seed} is beyond what torch takes: give a whole number from 0 to 2**63 - 1")
        if self.rope_cap is not None and (isinstance(self.rope_cap, bool) or not isinstance(self.rope_cap, int)
                                          or self.rope_cap < 0):
            raise SpecError(f"rope_cap must be a non-negative number of tokens (0 = no cap), got {self.rope_cap!r}")
        self.layers = parse_layers(self.layers)
        if self.dtype is not None:
            d = _DTYPE_ALIASES.get(str(self.dtype).lower(), str(self.dtype).lower().replace("torch.", ""))
            if d not in DTYPES:
                raise SpecError(f"dtype must be one of {', '.join(DTYPES)} (or unset), got {self.dtype!r}")
            self.dtype = d
        return self

    def validate_for(self, config: Any) -> None:
        """Checks that need the model: the method's (e.g. latents split over query heads), layer indices exist."""
        n_layers = int(config.num_hidden_layers)
        check_model = getattr(self.config, "check_model", None)
        if check_model is not None:
            check_model(config)
        sinks = getattr(self.config, "sinks", None)
        text_config = getattr(config, "text_config", None) or config
        max_pos = getattr(text_config, "max_position_embeddings", None)
        if isinstance(sinks, int) and isinstance(max_pos, int) and 0 < max_pos < sinks:
            raise SpecError(f"sinks={sinks} exceeds the model's max_position_embeddings={max_pos}: sinks are the "
                            "first tokens every query also attends to (StreamingLLM keeps 4); give at most "
                            f"{max_pos}")
        if self.layers == "global":
            global_layers(config)  # SpecError for a model that is not hybrid
        elif self.layers != "all":
            bad = [i for i in self.layers if i >= n_layers]
            if bad:
                raise SpecError(f"layers {bad[:8]}{' ...' if len(bad) > 8 else ''} do not exist: the model has {n_layers} layers (0..{n_layers - 1})")

    def layer_indices(self, config: Any) -> list[int]:
        """The layer indices this spec converts in a model with ``config``."""
        if self.layers == "all":
            return list(range(int(config.num_hidden_layers)))
        if self.layers == "global":
            return global_layers(config)
        return list(self.layers)

    def resolved(self, config: Any) -> "ConversionSpec":
        """A copy with model-dependent defaults made concrete (the window: DEFAULT_WINDOW, or the
        native window under ``layers: global``; ``rope_cap``: the base's context): what a checkpoint records."""
        from retrofit.surgery.rope_cap import default_rope_cap

        cap = default_rope_cap(config) if self.rope_cap is None else self.rope_cap
        return dataclasses.replace(self, config=self.config.resolved(config, self.layers), rope_cap=cap)

    @property
    def torch_dtype(self):
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Flat: ``method``, the method's keys, ``layers``, ``dtype``, ``seed``, ``rope_cap`` (a recipe / record)."""
        layers = list(self.layers) if isinstance(self.layers, list) else self.layers
        return {"method": self.method, **self.config.to_dict(), "layers": layers, "dtype": self.dtype, "seed": self.seed,
                "rope_cap": self.rope_cap}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The common keys (each method adds its config's fields)."""
        return COMMON_KEYS

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, allow_record_keys: bool = False) -> "ConversionSpec":
        """A spec from a flat mapping (recipe, record). ``allow_record_keys``: a checkpoint's
        record (its record keys dropped); one with ``options``, a pre-release retrofit's, is refused."""
        if not isinstance(data, Mapping):
            raise SpecError(f"a conversion spec must be a mapping, got {type(data).__name__}")
        data = dict(data)
        if allow_record_keys:
            for k in RECORD_KEYS:
                data.pop(k, None)
            if "options" in data:  # this version writes every method key flat, never an options mapping
                raise SpecError("the record has an 'options' mapping: it was written by a pre-release retrofit, "
                                "whose records this version does not read; convert the base model again (and "
                                "train the new layers again) with this version")
        common = {k: data.pop(k) for k in COMMON_KEYS if k in data}
        options = data.pop("options", None)
        return cls(**common, options=options, **data)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "ConversionSpec":
        """Read a flat YAML mapping (or its ``convert:`` section); ``overrides`` win (None = keep)."""
        import yaml

        p = Path(path)
        if not p.is_file():
            from retrofit.fs.guard import special_kind

            kind = special_kind(p)
            raise SpecError(f"conversion config {p} is {kind}; give a YAML file (retrofit ls lists the bundled convert "
                            "specs)" if kind else f"conversion config {p} does not exist")
        try:
            data = parse_yaml(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            from retrofit.errors import yaml_error_line

            raise SpecError(f"{p} is not valid YAML: {yaml_error_line(exc)}") from None
        except UnicodeDecodeError as exc:
            raise SpecError(f"{p} is not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
                            "save it as UTF-8") from None
        if data is None:  # an empty (or truncated) file: not the method's defaults, silently
            raise SpecError(f"conversion config {p} is empty: it holds no conversion keys (drop --config to "
                            "convert with the method's defaults)")
        if isinstance(data, dict) and isinstance(data.get("convert"), dict):
            data = data["convert"]
        if not isinstance(data, dict):
            raise SpecError(f"{p} must hold a mapping of conversion keys")
        data = dict(data)
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.from_dict(data)
        except SpecError as exc:
            raise SpecError(f"{p}: {exc}") from None

    def describe(self) -> str:
        layers = self.layers if isinstance(self.layers, str) else ",".join(map(str, self.layers))
        own = self.config.describe()
        return f"{self.method} ({own + ', ' if own else ''}layers={layers})"


def _check_keys(method: str, cls: Any, keys: Mapping[str, Any]) -> None:
    """Keys the method's config lacks: one error naming an unknown key or a key of another method."""
    extra = [k for k in keys if k not in cls.field_names()]
    if not extra:
        return
    owners = _all_method_keys()
    known = sorted(set(COMMON_KEYS) | set(owners))
    unknown = [k for k in extra if k not in owners]
    if unknown:
        raise SpecError(f"unknown conversion key(s): {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    own = ", ".join(cls.field_names()) or "none"
    parts = [f"{k} (a key of {', '.join(owners[k])})" for k in extra]
    raise SpecError(f"{', '.join(parts)} does not apply to method {method!r} (its keys: {own}); "
                    "drop it or choose another method")
