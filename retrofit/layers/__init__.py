"""nn.Modules that replace a pretrained attention module (keeping its projections by name) and
hold a method's new weights. See ``base.py`` for the forward contract and ``method.py`` for what
makes a method (config dataclass, builder, registration).

Importing this package imports each built-in method module once, which registers it.
"""
from retrofit.layers.base import RetrofitAttention
from retrofit.layers.cache import RetrofitCache, RetrofitLayerCache, layer_cache
from retrofit.layers.conv import CausalDepthwiseConv
from retrofit.layers.delta import DeltaAttention, DeltaConfig
from retrofit.layers.hedgehog import HedgehogAttention, HedgehogConfig
from retrofit.layers.exp_linear import ExpLinearAttention, ExpLinearConfig
from retrofit.layers.lavo import LavoAttention, LavoConfig, LavoLayerCache
from retrofit.layers.llp import LLPAttention, LLPConfig, LLPLayerCache
from retrofit.layers.macchiato import (
    DEFAULT_INIT_SWA_SHARE, MacchiatoAttention, MacchiatoConfig, MacchiatoLayerCache, swa_bias,
)
from retrofit.layers.method import (
    DEFAULT_WINDOW, MethodConfig, MethodInfo, MethodTestSpec, available_methods, get_method, register_method,
)
from retrofit.layers.window import WindowAttention, WindowConfig, WindowLayerCache

__all__ = [
    "DEFAULT_INIT_SWA_SHARE",
    "DEFAULT_WINDOW",
    "CausalDepthwiseConv",
    "DeltaAttention",
    "DeltaConfig",
    "ExpLinearAttention",
    "ExpLinearConfig",
    "HedgehogAttention",
    "HedgehogConfig",
    "LLPAttention",
    "LLPConfig",
    "LLPLayerCache",
    "LavoAttention",
    "LavoConfig",
    "LavoLayerCache",
    "MacchiatoAttention",
    "MacchiatoConfig",
    "MacchiatoLayerCache",
    "MethodConfig",
    "MethodInfo",
    "MethodTestSpec",
    "RetrofitAttention",
    "RetrofitCache",
    "RetrofitLayerCache",
    "WindowAttention",
    "WindowConfig",
    "WindowLayerCache",
    "available_methods",
    "get_method",
    "layer_cache",
    "register_method",
    "swa_bias",
]
