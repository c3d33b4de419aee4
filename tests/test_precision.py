"""``retrofit.precision``: the auto dtype follows the CPU's bf16 instructions, read independently here."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retrofit.precision import auto_dtype_name, fast_bf16


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo to read the CPU flags from")
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo lists no flags")


def test_cpu_bf16_matches_the_cpu_flags():
    native = bool({"avx512_bf16", "amx_bf16", "amx_tile"} & _cpu_flags())
    assert fast_bf16("cpu") is native
    assert auto_dtype_name("cpu") == ("bfloat16" if native else "float32")


def test_other_devices():
    assert fast_bf16("meta") is False and auto_dtype_name("meta") == "float32"
    if not torch.cuda.is_available():
        assert fast_bf16("cuda") is False
    else:
        assert fast_bf16("cuda") is torch.cuda.is_bf16_supported()
