"""``--device`` values checked up front: one error line instead of a CUDA traceback mid-run."""
from __future__ import annotations

from retrofit.errors import RetrofitError

__all__ = ["check_device"]


def check_device(name: str | None) -> str | None:
    """Return ``name`` if torch can use it (None = the caller's default), else raise :class:`RetrofitError`."""
    if name is None:
        return None
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise RetrofitError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RetrofitError(f"--device {name}: CUDA is not available on this machine (a CPU-only PyTorch, or no "
                                "GPU visible); use --device cpu or install a CUDA build of PyTorch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RetrofitError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type not in ("cpu", "mps", "xpu", "meta"):
        raise RetrofitError(f"--device {name!r}: unsupported device type; use cpu or cuda")
    return name
