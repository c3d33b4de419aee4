"""Training checkpoints on disk: atomic publication, discovery, rotation.

Layout of ``OUTPUT_DIR``::

    checkpoint-200/              complete checkpoints only (a folder is renamed into this name last)
        pytorch_model/           DeepSpeed engine state: trainable weights, optimizer shards, per rank
        random_states_<r>.pkl    RNG states per rank (accelerate)
        data_state_rank<r>.json  data position per rank (document stream, tail, shuffle buffer) ...
        data_state_rank<r>.npz   ... and its arrays (the carried tokens and the shuffle pool)
        trainer_state.json       step, tokens, world size, recipe fingerprint; written last
        .retrofit-files.json     the files the save wrote (:func:`retrofit.fs.atomic_directory`)
    .checkpoint-300.tmp-PID-HOST-RAND/   a save in progress (or killed): never resumed from, removed on start
    final/                       the exported model (retrofit.load-able)
    metrics.jsonl, recipe.yaml, tensorboard/

A checkpoint is published with :func:`retrofit.fs.atomic_directory`: all ranks write into its
temporary folder, then rank 0 writes ``trainer_state.json`` and the folder is renamed to
``checkpoint-N`` (a re-save of a step swaps the older folder out): a save that is killed at any
point leaves no ``checkpoint-N`` and no half one. Several nodes need a shared file system for
``OUTPUT_DIR`` (as DeepSpeed checkpoints do).
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Iterator

from retrofit.errors import CheckpointError
from retrofit.fs import atomic_directory, clean_stale_temps, remove_directory
from retrofit.fs.atomic import write_json_atomic as _write_json_atomic, write_manifest
from retrofit.fs.guard import MANIFEST, is_replaceable_checkpoint
from retrofit.fs.tempdirs import SWAP_KIND, recover_interrupted_swaps

__all__ = [
    "STATE_FILE", "checkpoint_dir", "list_checkpoints", "latest_checkpoint", "publishing", "write_state",
    "rotate", "clean_stale", "read_state", "write_json_atomic",
]

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
_CKPT = re.compile(r"^checkpoint-(\d+)$")
_SWAP = re.compile(rf"^\.(checkpoint-\d+)\.{SWAP_KIND}-")  # a replacement of checkpoint-N in progress (or killed)


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


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


def write_state(folder: Path, state: dict) -> Path:
    """Write ``trainer_state.json`` into the folder being published: its completeness marker, written last."""
    path = Path(folder) / STATE_FILE
    write_json_atomic(path, state)
    return path


@contextlib.contextmanager
def publishing(final: Path) -> Iterator[Path]:
    """Yield the temporary folder a checkpoint is written into; on success it becomes ``final``.

    Call it on one rank (the others write into the folder it yields) and end the block with
    :func:`write_state`. An existing ``final`` (a step saved again, e.g. after resuming from an
    earlier checkpoint) is replaced only once the new one is complete.
    """
    final = Path(final)
    if final.is_dir() and (final / STATE_FILE).is_file() and not (final / MANIFEST).exists():
        write_manifest(final)  # an earlier version's checkpoint (no manifest): the run's own, so replaceable
    with atomic_directory(final, overwrite=True) as tmp:
        yield tmp


def rotate(output_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return the deleted folders.

    Only a checkpoint exactly as retrofit wrote it goes (its manifest lists every file in it): one
    holding anything else (a user's note, eval results written into it, a folder retrofit did not
    write, a sub-folder it cannot read) stays, with a warning naming what kept it."""
    found = list_checkpoints(output_dir)
    deleted = []
    for _, p in found[: max(0, len(found) - keep_last)]:
        ok, why = is_replaceable_checkpoint(p)
        if not ok:
            log.warning("checkpoint rotation keeps %s: %s (delete it yourself if it is not needed)", p, why)
            continue
        remove_directory(p)
        deleted.append(p)
    return deleted


def clean_stale(output_dir: Path) -> None:
    """Settle and remove what killed saves and deletes left: a re-save killed between its swap's renames
    gets its checkpoint back (:func:`retrofit.fs.recover_interrupted_swaps`) and temporary folders of dead
    writers go. Call it only while no other process writes ``output_dir`` (the run holds its lock)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return
    for name in sorted({m.group(1) for p in output_dir.iterdir() if (m := _SWAP.match(p.name))}):
        recover_interrupted_swaps(output_dir / name)
    clean_stale_temps(output_dir)


def read_state(ckpt: Path) -> dict:
    f = Path(ckpt) / STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"{ckpt} is not a complete training checkpoint (no {STATE_FILE})")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{f} is not valid JSON: {exc}") from None
