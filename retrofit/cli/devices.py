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
    elif dev.type == "meta":
        raise RetrofitError(f"--device {name}: the meta device holds no data (shapes only), so nothing can run on "
                            "it; use cpu or cuda")
    elif dev.type in ("mps", "xpu"):
        if not _available(dev.type):
            what = "Apple Metal (MPS)" if dev.type == "mps" else "Intel XPU"
            raise RetrofitError(f"--device {name}: {what} is not available in this PyTorch build or on this "
                                "machine; use --device cpu (or cuda)")
    elif dev.type != "cpu":
        raise RetrofitError(f"--device {name!r}: unsupported device type; use cpu or cuda")
    return name


def _available(kind: str) -> bool:
    """Whether torch can run on the ``mps`` / ``xpu`` back-end here (False when the build lacks it)."""
    import torch

    try:
        if kind == "mps":
            return bool(torch.backends.mps.is_available())
        return bool(getattr(torch, "xpu", None) is not None and torch.xpu.is_available())
    except Exception:  # a build without the back-end may raise instead of answering
        return False
