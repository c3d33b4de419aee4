"""``ConversionSpec``: what to convert and how, from Python, CLI flags or a YAML recipe.

YAML (``configs/convert-*.yaml``) is a flat mapping of the fields below, or a mapping with a
``convert:`` section holding them (so training recipes can embed the conversion)::

    method: macchiato
    window: 128           # default: 128, or the family's native window with layers: global
    latents: 128          # total over query heads (L); L / Hq latents per head
    init_swa_share: 0.9   # initial p(0|t), the sliding-window share
    conv_size: 0          # >1 adds a causal depthwise conv before the latent projections
    sinks: 0              # attention sinks: the window branch also sees the first n tokens
    layers: all           # "global" (a hybrid model's full-attention layers), indices, or "0-5,8"
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from retrofit.errors import SpecError

__all__ = ["ConversionSpec", "DEFAULT_INIT_SWA_SHARE", "DEFAULT_WINDOW", "DTYPES", "global_layers", "parse_layers"]

# The initial sliding-window share p(0|t) of a fresh Macchiato layer: one constant, defined next
# to the layer (0.9, chosen by the SWA-share ablation in BENCHMARKS.md).
from retrofit.layers.macchiato import DEFAULT_INIT_SWA_SHARE  # noqa: E402

# The sliding window of a converted layer unless the spec names one (the paper's w); with
# ``layers: global`` the family's native window (Gemma 3: 512) is the default instead.
DEFAULT_WINDOW = 128
LAYER_KEYWORDS = ("all", "global")

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
# keys a checkpoint's record carries besides the spec fields
RECORD_KEYS = ("toolkit_version", "base_model", "converted_layers")
# no model has this many layers: indices are checked against it before a range is expanded
# (the model's own count is checked by validate_for)
MAX_LAYER_INDEX = 4095


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


@dataclass
class ConversionSpec:
    """How to convert a model. Validated on construction (``SpecError`` with what to fix)."""

    method: str = "macchiato"
    window: int | None = None  # None: DEFAULT_WINDOW, or the native window under layers: global
    latents: int = 128
    init_swa_share: float = DEFAULT_INIT_SWA_SHARE
    conv_size: int = 0
    sinks: int = 0  # the SWA branch also attends to the first `sinks` tokens (StreamingLLM's sinks)
    layers: str | list[int] = "all"
    dtype: str | None = None
    chunk_size: int = 64
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # method-specific (see register_method)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ConversionSpec":
        from retrofit.surgery.methods import get_method  # registry lives next door

        info = get_method(self.method)  # SpecError naming the known methods
        for name in ("window", "latents", "conv_size", "sinks", "chunk_size", "seed"):
            v = getattr(self, name)
            if name == "window" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(f"{name} must be an integer, got {v!r}")
        if self.window is not None and self.window < 1:
            raise SpecError(f"window must be >= 1 token, got {self.window}")
        if self.latents < 0:
            raise SpecError(f"latents must be >= 0, got {self.latents}")
        if self.sinks < 0:
            raise SpecError(f"sinks must be >= 0 (0 = a plain sliding window), got {self.sinks}")
        if self.conv_size < 0:
            raise SpecError(f"conv_size must be >= 0 (0 or 1 = no conv), got {self.conv_size}")
        if self.chunk_size < 1:
            raise SpecError(f"chunk_size must be >= 1, got {self.chunk_size}")
        try:
            share = float(self.init_swa_share)
        except (TypeError, ValueError):
            raise SpecError(f"init_swa_share must be a number in (0, 1], got {self.init_swa_share!r}") from None
        if not 0.0 < share <= 1.0:
            raise SpecError(f"init_swa_share must be in (0, 1] (1 = latent path closed), got {share}")
        self.init_swa_share = share
        self.layers = parse_layers(self.layers)
        if self.dtype is not None:
            d = _DTYPE_ALIASES.get(str(self.dtype).lower(), str(self.dtype).lower().replace("torch.", ""))
            if d not in DTYPES:
                raise SpecError(f"dtype must be one of {', '.join(DTYPES)} (or unset), got {self.dtype!r}")
            self.dtype = d
        if not isinstance(self.options, dict):
            raise SpecError(f"options must be a mapping, got {self.options!r}")
        unknown = set(self.options) - set(info.options)
        if unknown:
            allowed = ", ".join(sorted(info.options)) or "none"
            raise SpecError(f"method {self.method!r} has no option(s) {', '.join(sorted(unknown))}; allowed: {allowed}")
        return self

    def validate_for(self, config: Any) -> None:
        """Checks that need the model: latents split over query heads, layer indices exist."""
        heads = int(config.num_attention_heads)
        n_layers = int(config.num_hidden_layers)
        from retrofit.surgery.methods import get_method

        if "latents" in get_method(self.method).uses and self.latents % heads:
            lo, hi = (self.latents // heads) * heads, (self.latents // heads + 1) * heads
            raise SpecError(
                f"latents={self.latents} does not split over the model's {heads} query heads; "
                f"use a multiple of {heads} (e.g. {lo or hi} or {hi})"
            )
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
        """A copy with the window made concrete for this model (what a checkpoint records)."""
        if self.window is not None:
            return dataclasses.replace(self)
        native = getattr(config, "sliding_window", None) if self.layers == "global" else None
        return dataclasses.replace(self, window=int(native) if native else DEFAULT_WINDOW)

    @property
    def torch_dtype(self):
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, allow_record_keys: bool = False) -> "ConversionSpec":
        if not isinstance(data, Mapping):
            raise SpecError(f"a conversion spec must be a mapping, got {type(data).__name__}")
        known = set(cls.field_names())
        extra = set(RECORD_KEYS) if allow_record_keys else set()
        unknown = set(data) - known - extra
        if unknown:
            raise SpecError(f"unknown conversion key(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "ConversionSpec":
        """Read a flat YAML mapping (or its ``convert:`` section); ``overrides`` win (None = keep)."""
        import yaml

        p = Path(path)
        if not p.is_file():
            raise SpecError(f"conversion config {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise SpecError(f"{p} is not valid YAML: {exc}") from None
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
        from retrofit.surgery.methods import get_method

        uses = get_method(self.method).uses
        parts = [f"{k}={getattr(self, k)}" for k in ("window", "latents", "init_swa_share", "conv_size", "sinks")
                 if k in uses and not (k == "sinks" and not self.sinks)]
        parts.append(f"layers={self.layers if isinstance(self.layers, str) else ','.join(map(str, self.layers))}")
        if self.options:
            parts.append(f"options={self.options}")
        return f"{self.method} ({', '.join(parts)})"
