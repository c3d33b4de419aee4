"""Which floating-point dtype runs fast where: the ``auto`` evaluation dtype (``retrofit eval
--dtype auto``, ``retrofit demo --eval-dtype auto``). Training keeps its own ``auto`` (fp32 on a CPU).
And how to cast a model to a dtype without touching its RoPE frequencies (:func:`cast_parameters`).

On a CPU, bf16 matmuls are only fast where the cores have bf16 dot-product instructions
(AVX512-BF16 on Zen 4 / Cooper Lake and later, AMX on Sapphire Rapids); elsewhere oneDNN emulates
them and bf16 is slower than fp32. Measured on the 2-core Zen 4 machine of BENCHMARKS.md: an
LM-head block (2048 x 640 @ 640 x 8192) runs at 344 GFLOP/s in bf16 and 129 GFLOP/s in fp32.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["fast_bf16", "auto_dtype_name", "cast_parameters"]


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``model``'s floating-point parameters to ``dtype`` in place, leaving its buffers alone, as
    ``from_pretrained(dtype=...)`` does. ``model.to(dtype)`` would also round the rotary embedding's
    fp32 ``inv_freq`` buffers (to 3 significant digits in bf16): every RoPE frequency then moves by
    up to 0.4%, a different positional code than the model was trained with, and a key rotated with
    it no longer matches the config's frequencies (which the RoPE distance cap re-rotates with)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """True if bf16 matmuls on ``device`` run on native bf16 units (so bf16 is the faster dtype)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if dev.type == "cpu":
        cpu = torch.cpu
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)
    return False


def auto_dtype_name(device: str | torch.device = "cpu") -> str:
    """``"bfloat16"`` where :func:`fast_bf16`, else ``"float32"``."""
    return "bfloat16" if fast_bf16(device) else "float32"
