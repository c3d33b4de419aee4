"""Registry of conversion methods: name -> builder of the replacement attention module.

Adding a method (e.g. LAVO, LLP) needs no edit here::

    from retrofit.surgery import register_method

    def build_lavo(original, patch, spec, layer_idx, generator):
        return LavoAttention(original, patch, rank=spec.options.get("rank", 64), window=spec.window, ...)

    register_method("lavo", build_lavo, uses=("window",), options={"rank": 64},
                    description="LAVO: orthogonal memory + local window")

A builder receives the pretrained attention module, the family patch
(``retrofit.patches.AttentionPatch``), the validated :class:`ConversionSpec`, the layer index
and a seeded ``torch.Generator``, and returns an ``nn.Module`` that

* keeps the pretrained submodules under their names (subclass ``retrofit.layers.RetrofitAttention``),
* sets ``is_retrofit_attention = True`` and implements ``new_parameter_names()`` (its new
  weights, trainable after conversion) and ``new_cache_layer()`` (its decoding state),
* follows the forward contract in ``retrofit/layers/base.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from retrofit.errors import SpecError

__all__ = ["MethodInfo", "register_method", "get_method", "available_methods"]

Builder = Callable[..., Any]


@dataclass(frozen=True)
class MethodInfo:
    name: str
    builder: Builder
    uses: tuple[str, ...] = ()  # which ConversionSpec fields the method reads (for records / help)
    options: dict[str, Any] = field(default_factory=dict)  # allowed spec.options keys -> defaults
    description: str = ""


_METHODS: dict[str, MethodInfo] = {}


def register_method(
    name: str,
    builder: Builder,
    *,
    uses: tuple[str, ...] = (),
    options: dict[str, Any] | None = None,
    description: str = "",
    overwrite: bool = False,
) -> MethodInfo:
    """Register a conversion method under ``name`` (``--method name`` on the CLI)."""
    if name in _METHODS and not overwrite:
        raise ValueError(f"method {name!r} is already registered (pass overwrite=True to replace it)")
    info = MethodInfo(name, builder, tuple(uses), dict(options or {}), description)
    _METHODS[name] = info
    return info


def available_methods() -> list[str]:
    _load_builtin()
    return sorted(_METHODS)


def get_method(name: str) -> MethodInfo:
    _load_builtin()
    if name not in _METHODS:
        raise SpecError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    return _METHODS[name]


# ---------------------------------------------------------------------- built-in methods
def _build_macchiato(original, patch, spec, layer_idx, generator):
    from retrofit.layers import MacchiatoAttention

    return MacchiatoAttention(
        original, patch, window=spec.window, latents=spec.latents, init_swa_share=spec.init_swa_share,
        conv_size=spec.conv_size, chunk_size=spec.chunk_size, sinks=spec.sinks, generator=generator,
    )


def _build_exp_linear(original, patch, spec, layer_idx, generator):
    from retrofit.layers import ExpLinearAttention

    return ExpLinearAttention(original, patch, chunk_size=spec.chunk_size)


_BUILTIN_LOADED = False


def _load_builtin() -> None:
    global _BUILTIN_LOADED
    if _BUILTIN_LOADED:
        return
    _BUILTIN_LOADED = True
    builtin = [
        MethodInfo(
            "macchiato", _build_macchiato, ("window", "latents", "init_swa_share", "conv_size", "sinks", "chunk_size"), {},
            "Latte Macchiato: pretrained attention as a w-token sliding window + trainable latent states",
        ),
        MethodInfo(
            "exp-linear", _build_exp_linear, ("chunk_size",), {},
            "exp(Q)exp(K)^T linear attention over the pretrained projections (no new weights)",
        ),
    ]
    from retrofit.layers import lavo, llp

    builtin += [
        MethodInfo("lavo", lavo.build_lavo, **{**lavo.LAVO_METHOD, "uses": tuple(lavo.LAVO_METHOD["uses"])}),
        MethodInfo("llp", llp.build_llp, **{**llp.LLP_METHOD, "uses": tuple(llp.LLP_METHOD["uses"])}),
    ]
    for info in builtin:
        _METHODS.setdefault(info.name, info)  # a registration made before first use wins
