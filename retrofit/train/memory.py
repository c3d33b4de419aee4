"""Refuse a sequence length the machine cannot hold, before the first step rather than in it.

:func:`step_memory_floor` is a *lower bound* of one training micro-step's activation memory
(what any implementation must hold), so the check never rejects a run that could fit:

* the logits and their gradient in fp32 (the loss upcasts): ``2 * 4 * tokens * vocab`` bytes;
* the inputs of every decoder layer kept for the backward pass (all that activation
  checkpointing keeps): ``layers * tokens * hidden * act_bytes``.

A real step needs more (one layer's recompute, the MLP, attention states), so a run that
passes the check can still run out of memory; :func:`is_out_of_memory` recognises that error
for the training loop to turn into the same advice.
"""
from __future__ import annotations

from typing import Any

import torch

from retrofit.errors import TrainingError

__all__ = ["step_memory_floor", "available_memory", "check_step_fits", "is_out_of_memory", "memory_advice"]

GiB = 1024**3


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def step_memory_floor(config: Any, *, micro_batch_size: int, seq_len: int, act_bytes: int) -> int:
    """Bytes one forward + backward of ``micro_batch_size x seq_len`` tokens needs at least."""
    c = _text_config(config)
    tokens = int(micro_batch_size) * int(seq_len)
    logits = 2 * 4 * tokens * int(c.vocab_size)
    saved = int(c.num_hidden_layers) * tokens * int(c.hidden_size) * int(act_bytes)
    return logits + saved


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (CUDA: free device memory; CPU: the OS's available memory)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def memory_advice(seq_len: int, micro_batch_size: int) -> str:
    return (f"lower data.seq_len (now {seq_len}) or train.micro_batch_size (now {micro_batch_size}; raise "
            "train.batch_size/accumulation instead), keep train.gradient_checkpointing=true, or shard more with "
            "deepspeed.zero_stage=3 / deepspeed.offload_optimizer=true")


def check_step_fits(config: Any, *, micro_batch_size: int, seq_len: int, act_bytes: int, device: torch.device,
                    reserved: int = 0) -> int:
    """Raise :class:`TrainingError` if the floor (plus ``reserved`` bytes) exceeds free memory; return the floor."""
    need = step_memory_floor(config, micro_batch_size=micro_batch_size, seq_len=seq_len, act_bytes=act_bytes)
    free = available_memory(device)
    if need + reserved > free:
        raise TrainingError(
            f"a training step at data.seq_len={seq_len} x micro_batch_size={micro_batch_size} needs at least "
            f"{(need + reserved) / GiB:.1f} GiB on {device.type} (logits and saved layer inputs alone: "
            f"{need / GiB:.1f} GiB) but only {free / GiB:.1f} GiB is free: {memory_advice(seq_len, micro_batch_size)}"
        )
    return need


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in msg or "can't allocate memory" in msg or "cannot allocate memory" in msg
        or isinstance(exc, MemoryError)
    )
