"""nn.Modules that replace a pretrained attention module (keeping its projections by name) and
hold a method's new weights. See ``base.py`` for the forward contract, ``method.py`` for what
makes a method (config dataclass, builder, registration) and ``decoding.py`` for what a layer
implements to be decoded by the compiled step (:class:`retrofit.decoding.CompiledDecoder`).

Importing this package imports each built-in method module once, which registers it.
"""
from retrofit.layers.base import RetrofitAttention
from retrofit.layers.cache import RetrofitCache, RetrofitLayerCache, layer_cache
from retrofit.layers.conv import CausalDepthwiseConv
from retrofit.layers.decoding import CompiledDecodingLayer, DecodingBuffers, supports_compiled_decoding
from retrofit.layers.delta import DeltaAttention, DeltaConfig, DeltaDecodingBuffers
from retrofit.layers.hedgehog import HedgehogAttention, HedgehogConfig, HedgehogDecodingBuffers
from retrofit.layers.exp_linear import ExpLinearAttention, ExpLinearConfig
from retrofit.layers.lavo import LavoAttention, LavoConfig, LavoLayerCache
from retrofit.layers.llp import LLPAttention, LLPConfig, LLPLayerCache
from retrofit.layers.macchiato import (
    DEFAULT_INIT_SWA_SHARE, MacchiatoAttention, MacchiatoConfig, MacchiatoDecodingBuffers, MacchiatoLayerCache,
    swa_bias,
)
from retrofit.layers.method import (
    DEFAULT_WINDOW, MethodConfig, MethodInfo, MethodTestSpec, available_methods, get_method, register_method,
)
from retrofit.layers.window import WindowAttention, WindowConfig, WindowDecodingBuffers, WindowLayerCache

__all__ = [
    "DEFAULT_INIT_SWA_SHARE",
    "DEFAULT_WINDOW",
    "CausalDepthwiseConv",
    "CompiledDecodingLayer",
    "DecodingBuffers",
    "DeltaAttention",
    "DeltaConfig",
    "DeltaDecodingBuffers",
    "ExpLinearAttention",
    "ExpLinearConfig",
    "HedgehogAttention",
    "HedgehogConfig",
    "HedgehogDecodingBuffers",
    "LLPAttention",
    "LLPConfig",
    "LLPLayerCache",
    "LavoAttention",
    "LavoConfig",
    "LavoLayerCache",
    "MacchiatoAttention",
    "MacchiatoConfig",
    "MacchiatoDecodingBuffers",
    "MacchiatoLayerCache",
    "MethodConfig",
    "MethodInfo",
    "MethodTestSpec",
    "RetrofitAttention",
    "RetrofitCache",
    "RetrofitLayerCache",
    "WindowAttention",
    "WindowConfig",
    "WindowDecodingBuffers",
    "WindowLayerCache",
    "available_methods",
    "get_method",
    "layer_cache",
    "register_method",
    "supports_compiled_decoding",
    "swa_bias",
]
