"""Process set-up and the DeepSpeed config for one run.

Launch modes, all through the same code:

* ``deepspeed --no_local_rank --module retrofit.cli.main train RECIPE`` or
  ``torchrun --nproc_per_node N -m retrofit.cli.main train RECIPE``: the launcher sets
  ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``;
* a plain process (``retrofit train RECIPE``): DeepSpeed still needs a process group, so
  :func:`single_process_env` makes a one-rank world on a free local port.

The DeepSpeed JSON holds the ZeRO settings; everything the recipe also states (batch sizes,
gradient accumulation, clipping, precision, ZeRO stage and offload overrides) is written into
it from the recipe, so the two cannot disagree.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Iterator

from retrofit.errors import SpecError
from retrofit.train.recipe import Recipe, bundled_recipe_dir

__all__ = ["single_process_env", "world_from_env", "deepspeed_config", "resolve_precision", "grad_accum_steps",
           "no_shared_memory_comm"]

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def single_process_env() -> Iterator[bool]:
    """Inside: launcher variables present (a one-rank world if none were). Yields whether it made them.

    Also sets ``ACCELERATE_USE_DEEPSPEED`` (accelerate then lets DeepSpeed own the process group).
    Everything it set is restored on exit.
    """
    saved = {k: os.environ.get(k) for k in (*_LAUNCH_VARS, "ACCELERATE_USE_DEEPSPEED")}
    made = "RANK" not in os.environ or "WORLD_SIZE" not in os.environ
    if made:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        yield made
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def no_shared_memory_comm(world_size: int) -> Iterator[None]:
    """Inside, with one rank: DeepSpeed's CPU shared-memory collective is reported incompatible.

    DeepSpeed's torch backend JIT-compiles that C++ op when its process group starts (~35 s in every
    fresh environment: the extension cache is keyed by the venv). It only speeds up all-reduces
    across the ranks of one node, so a one-rank run has no use for it. Several ranks keep it.
    """
    compatible = None
    if world_size == 1:
        try:
            import deepspeed.ops

            compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        except ImportError:
            pass
    if not isinstance(compatible, dict):
        yield
        return
    name, saved = "deepspeed_shm_comm", compatible.get("deepspeed_shm_comm")
    compatible[name] = False
    try:
        yield
    finally:
        if saved is None:
            compatible.pop(name, None)
        else:
            compatible[name] = saved


def world_from_env() -> tuple[int, int]:
    """``(rank, world_size)`` from the launcher variables."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def resolve_precision(precision: str, cuda: bool) -> str:
    """``auto`` -> ``bf16`` on a GPU that supports it, else ``fp32``."""
    import torch

    if precision == "auto":
        return "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16" and not cuda:
        return "bf16"  # allowed (DeepSpeed's CPU accelerator supports it) but slow on most CPUs
    return precision


def grad_accum_steps(recipe: Recipe, world_size: int) -> int:
    t = recipe.train
    per_step = t.micro_batch_size * world_size
    if t.batch_size % per_step:
        raise SpecError(
            f"train.batch_size ({t.batch_size}) must be a multiple of micro_batch_size ({t.micro_batch_size}) "
            f"x data-parallel ranks ({world_size}) = {per_step}"
        )
    return t.batch_size // per_step


def _config_file(recipe: Recipe) -> Path:
    name = recipe.deepspeed.config
    p = recipe.resolve_input(name)
    if p.is_file():
        return p
    bundled = bundled_recipe_dir() / name
    if bundled.is_file():
        return bundled
    raise SpecError(f"DeepSpeed config {name!r} not found (looked at {p} and {bundled})")


def deepspeed_config(recipe: Recipe, *, world_size: int, precision: str, cuda: bool) -> dict:
    """The DeepSpeed JSON with the recipe's batch, clipping, precision, stage and offload written in."""
    file = _config_file(recipe)
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise SpecError(f"DeepSpeed config {file} is not valid JSON: {exc}") from None
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise SpecError(f"DeepSpeed config {file} has an '{section}' section: remove it, the recipe's train "
                            "section sets the optimizer and learning-rate schedule")
    ds = recipe.deepspeed
    zero = dict(cfg.get("zero_optimization") or {})
    if ds.zero_stage is not None:
        zero["stage"] = ds.zero_stage
    stage = int(zero.get("stage", 0))
    if ds.offload_optimizer:
        if stage == 0:
            raise SpecError("deepspeed.offload_optimizer needs ZeRO stage 1, 2 or 3")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": bool(cuda)}
    if ds.offload_params:
        if stage != 3:
            raise SpecError("deepspeed.offload_params needs ZeRO stage 3 (deepspeed.zero_stage=3)")
        zero["offload_param"] = {"device": "cpu", "pin_memory": bool(cuda)}
    t = recipe.train
    cfg.update(
        zero_optimization=zero,
        train_micro_batch_size_per_gpu=t.micro_batch_size,
        gradient_accumulation_steps=grad_accum_steps(recipe, world_size),
        train_batch_size=t.batch_size,
        gradient_clipping=float(t.grad_clip),
        bf16={"enabled": precision == "bf16"},
        fp16={"enabled": False},
    )
    cfg.setdefault("steps_per_print", 10**9)
    if stage < 3:
        for key in [k for k in zero if k.startswith("stage3_")]:
            zero.pop(key)
    return cfg
