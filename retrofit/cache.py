"""Compatibility name: the decoding cache lives with the layers, :mod:`retrofit.layers.cache`."""
from retrofit.layers.cache import RetrofitCache, RetrofitLayerCache, layer_cache

__all__ = ["RetrofitLayerCache", "RetrofitCache", "layer_cache"]
