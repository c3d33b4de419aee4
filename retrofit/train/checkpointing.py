"""Training checkpoints on disk: atomic publication, discovery, rotation.

Layout of ``OUTPUT_DIR``::

    checkpoint-200/            complete checkpoints only (a folder is renamed into this name last)
        pytorch_model/         DeepSpeed engine state: trainable weights, optimizer shards, per rank
        random_states_<r>.pkl  RNG states per rank (accelerate)
        data_state_rank<r>.pt  data position per rank (document stream, tail, shuffle buffer)
        trainer_state.json     step, tokens, world size, recipe fingerprint; written last
    .tmp-checkpoint-300/       a save in progress (or killed): never resumed from, removed on start
    final/                     the exported model (retrofit.load-able)
    metrics.jsonl, recipe.yaml, tensorboard/

All ranks write into the temporary folder, then rank 0 writes ``trainer_state.json`` and
renames the folder: a save that is killed at any point leaves no ``checkpoint-N``. Several
nodes need a shared file system for ``OUTPUT_DIR`` (as DeepSpeed checkpoints do).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from retrofit.errors import CheckpointError
from retrofit.fs.atomic import fsync_dir, write_json_atomic as _write_json_atomic

__all__ = [
    "STATE_FILE", "checkpoint_dir", "temp_dir", "list_checkpoints", "latest_checkpoint", "publish",
    "remove_dir", "rotate", "clean_stale", "read_state", "write_json_atomic",
]

STATE_FILE = "trainer_state.json"
_CKPT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def temp_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / f".tmp-checkpoint-{step}"


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete checkpoints, oldest first."""
    out = []
    if Path(output_dir).is_dir():
        for p in Path(output_dir).iterdir():
            m = _CKPT.match(p.name)
            if m and p.is_dir() and (p / STATE_FILE).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to ``path`` via a temporary file, fsync and rename (keys sorted; no fallback encoder)."""
    _write_json_atomic(path, data, sort_keys=True, default=None)


def publish(tmp: Path, final: Path, state: dict) -> Path:
    """Write the state file into ``tmp`` (the completeness marker) and rename ``tmp`` to ``final``."""
    write_json_atomic(tmp / STATE_FILE, state)
    if final.exists():  # a re-save of the same step (e.g. after resuming from it): replace it
        remove_dir(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return final


def remove_dir(path: Path) -> None:
    """Rename out of the way first, then delete: an interrupted delete leaves no valid-looking folder."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def rotate(output_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return the deleted folders."""
    found = list_checkpoints(output_dir)
    doomed = [p for _, p in found[: max(0, len(found) - keep_last)]]
    for p in doomed:
        remove_dir(p)
    return doomed


def clean_stale(output_dir: Path) -> None:
    """Remove leftovers of killed saves and deletes (``.tmp-checkpoint-*``, ``.trash-*``)."""
    if not Path(output_dir).is_dir():
        return
    for p in Path(output_dir).iterdir():
        if p.is_dir() and (p.name.startswith(".tmp-checkpoint-") or p.name.startswith(".trash-")):
            shutil.rmtree(p, ignore_errors=True)


def read_state(ckpt: Path) -> dict:
    f = Path(ckpt) / STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"{ckpt} is not a complete training checkpoint (no {STATE_FILE})")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{f} is not valid JSON: {exc}") from None
