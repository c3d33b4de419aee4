"""retrofit: linear-time attention retrofits for pretrained LLMs.

Layers of the package (dependency arrows point one way):
``ops`` (pure tensor math) <- ``layers`` (modules holding new weights) <-
``patches`` / ``surgery`` (model families, conversion, checkpoints, cache) <-
``train`` / ``eval`` / ``cli``.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "convert", "load", "ConversionSpec"]


def __getattr__(name: str):  # lazy: importing retrofit must not import transformers
    if name in ("convert", "load", "ConversionSpec"):
        from retrofit import surgery

        return getattr(surgery, name)
    raise AttributeError(f"module 'retrofit' has no attribute {name!r}")
