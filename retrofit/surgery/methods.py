"""The method registry, under its historical name (``retrofit.surgery.register_method``).

A method is one module (see ``docs/extending.md`` and :mod:`retrofit.layers.method`): its config
dataclass, its layer, its builder, its cache entry and one ``register_method`` call. The registry
itself lives in the layers tier, so a method module registers itself without importing surgery::

    from dataclasses import dataclass
    from retrofit.layers.method import MethodConfig, opt, register_method

    @dataclass
    class ToyConfig(MethodConfig):
        gain: float = opt(1.0, "output gain")

    def build_toy(original, patch, spec, layer_idx, generator):
        return ToyAttention(original, patch, gain=spec.config.gain)

    register_method("toy", build_toy, config=ToyConfig, description="...")

A builder receives the pretrained attention module, the family patch
(``retrofit.patches.AttentionPatch``), the validated :class:`ConversionSpec` (``spec.config``:
the method's config, window resolved), the layer index and a seeded ``torch.Generator``, and
returns an ``nn.Module`` that

* keeps the pretrained submodules under their names (subclass ``retrofit.layers.RetrofitAttention``),
* sets ``is_retrofit_attention = True`` and implements ``new_parameter_names()`` (its new
  weights, trainable after conversion) and ``new_cache_layer()`` (its decoding state),
* follows the forward contract in ``retrofit/layers/base.py``.
"""
from __future__ import annotations

from retrofit.layers.method import MethodConfig, MethodInfo, available_methods, get_method, register_method

__all__ = ["MethodConfig", "MethodInfo", "register_method", "get_method", "available_methods"]
