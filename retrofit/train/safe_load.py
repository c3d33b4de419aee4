"""Resume without executing code: every ``torch.load`` of a training checkpoint is ``weights_only``.

DeepSpeed and accelerate store engine, optimizer and RNG state as pickles and load them with
``weights_only=False``, so a planted ``optim_states.pt`` would run arbitrary code on resume.
Inside :func:`weights_only_loads` every ``torch.load`` call is forced to ``weights_only=True``
(PyTorch's restricted unpickler: tensors, containers, numbers, strings) plus the explicit
allow-list :func:`allowed_globals` of the plain-data types DeepSpeed and accelerate write. Anything
else (a ``__reduce__`` calling ``os.system``, an unknown class) is refused with a
:class:`~retrofit.errors.CheckpointError` naming the file, before any of it is constructed.
"""
from __future__ import annotations

import contextlib
import pickle
from typing import Any, Iterator

import torch

from retrofit.errors import CheckpointError

__all__ = ["allowed_globals", "check_random_states", "weights_only_loads"]


def allowed_globals() -> list[Any]:
    """The types a DeepSpeed ZeRO / accelerate checkpoint holds besides tensors and containers.

    * ``ZeroStageEnum`` (an IntEnum), ``LossScaler`` (a few numbers), ``fragment_address``
      (a dataclass of two ints): DeepSpeed optimizer state;
    * numpy arrays and dtypes: accelerate's saved numpy RNG state.
    """
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    allowed: list[Any] = [np.ndarray, np.dtype, _reconstruct]
    allowed += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.uint8, np.int32)]
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed += [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    except ImportError:  # the train extra is not installed: nothing of DeepSpeed's to allow
        pass
    return allowed


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within the block, ``torch.load`` refuses everything but tensors, plain data and :func:`allowed_globals`.

    A refusal is raised again when the block ends even if the caller swallowed it (accelerate
    catches any error loading its RNG file and resumes without it).
    """
    original = torch.load
    refused: list[CheckpointError] = []

    def safe_load(f, *args: Any, **kwargs: Any):
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()
            detail = next((line for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first else "")
            refused.append(CheckpointError(
                f"{f}: refusing to load it: it holds objects outside the allow-list of plain training state "
                f"({detail.strip()[:200]}). Resume only from checkpoints this toolkit wrote; if you did write it, "
                "the file was altered or the DeepSpeed version stores a new type (see docs/training.md, trust model)"
            ))
            raise refused[-1] from None

    with torch.serialization.safe_globals(allowed_globals()):
        torch.load = safe_load
        try:
            yield
        finally:
            torch.load = original
    if refused:
        raise refused[0]


def check_random_states(folder: Any, rank: int) -> None:
    """``random_states_<rank>.pkl`` loads as plain data (accelerate would resume without it, silently)."""
    from pathlib import Path

    path = Path(folder) / f"random_states_{rank}.pkl"
    if not path.is_file():
        return
    with weights_only_loads():
        try:
            torch.load(path, map_location="cpu")
        except CheckpointError:
            raise
        except Exception as exc:  # truncated or garbage: unreadable, whatever the pickle error
            detail = (str(exc).strip().splitlines() or [""])[0][:160]
            raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {detail}); its random "
                                  "states would be lost: resume from an earlier checkpoint (checkpoint.resume=PATH) "
                                  "or delete this one") from None
