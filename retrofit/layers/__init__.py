"""nn.Modules that replace a pretrained attention module (keeping its projections by name) and
hold a method's new weights. See ``base.py`` for the forward contract."""
from retrofit.layers.base import RetrofitAttention
from retrofit.layers.conv import CausalDepthwiseConv
from retrofit.layers.exp_linear import ExpLinearAttention
from retrofit.layers.lavo import LavoAttention, LavoLayerCache
from retrofit.layers.llp import LLPAttention, LLPLayerCache
from retrofit.layers.macchiato import DEFAULT_INIT_SWA_SHARE, MacchiatoAttention, swa_bias

__all__ = [
    "DEFAULT_INIT_SWA_SHARE",
    "CausalDepthwiseConv",
    "ExpLinearAttention",
    "LLPAttention",
    "LLPLayerCache",
    "LavoAttention",
    "LavoLayerCache",
    "MacchiatoAttention",
    "RetrofitAttention",
    "swa_bias",
]
