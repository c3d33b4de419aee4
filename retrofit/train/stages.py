"""Multi-stage recipes: attention transfer, then KL, then (optionally) LoRA, from one YAML.

A recipe with a ``stages:`` list runs each stage as a recipe of its own: the stage's keys are
merged over the recipe's (a partial recipe; ``name`` names the stage), and stage ``i + 1``
starts from the model stage ``i`` exported. Every stage writes into
``OUTPUT_DIR/stage-<i>-<name>/`` (checkpoints, metrics, ``final/``); the last stage's
``final/`` is the result, also reachable as ``OUTPUT_DIR/final`` (a relative symbolic link, so
``retrofit eval OUTPUT_DIR/final`` works for a staged run as for a single one).

    stages:
      - {name: transfer, train: {objective: attention, max_steps: 300, lr: 3e-3}}
      - {name: kl, train: {objective: kl, max_steps: 50, lr: 1e-3}}

Resume (``checkpoint.resume: auto``) continues inside whichever stage was running; finished
stages (their ``DONE`` marker) are skipped. Each ``DONE`` records its own id and the id of the
stage before it: a later stage trained on output that is not (or no longer) the current one of
the stage before it is refused, as is a run that would re-run a stage while later stages hold
work built on its former output. ``OUTPUT_DIR/stages.json`` records the stage list and the
recipe: a run with other settings (other than ``checkpoint.keep_last`` / ``resume`` and
``logging``) refuses to continue the folder and names the keys that changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from retrofit.errors import CheckpointError, SpecError
from retrofit.fs.atomic import symlink_atomic, write_json_atomic
from retrofit.train.recipe import Recipe, stage_name, stage_recipes

if TYPE_CHECKING:
    from retrofit.train.loop import TrainCallback, TrainResult

__all__ = ["stage_recipes", "train_stages"]

def _write_json(path: Path, data: dict) -> None:
    write_json_atomic(path, data, indent=1, default=str)


def _stage_list_hash(recipe: Recipe) -> dict:
    """``stages.json``: the stage names, the recipe (as JSON data) and, for older readers, its hash."""
    data = recipe.to_dict()
    data.pop("fit", None)  # read by `retrofit fit` only; folders written before the section existed stay valid
    data["checkpoint"].pop("resume", None)
    data["logging"] = {}
    text = json.dumps(data, sort_keys=True, default=str)
    settings = json.loads(text)
    settings["checkpoint"].pop("keep_last", None)  # how many checkpoints stay on disk changes no result
    return {"hash": hashlib.sha256(text.encode()).hexdigest()[:16],
            "stages": [stage_name(i, s) for i, s in enumerate(recipe.stages, start=1)], "recipe": settings}


def _flat(data: object, prefix: str = "") -> dict[str, object]:
    if isinstance(data, dict):
        out: dict[str, object] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def _changed_keys(theirs: dict, mine: dict) -> list[str]:
    """Dotted keys whose value differs (``stages`` as one key per differing stage)."""
    a, b = _flat({k: v for k, v in theirs.items() if k != "stages"}), _flat({k: v for k, v in mine.items() if k != "stages"})
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    old, new = theirs.get("stages") or [], mine.get("stages") or []
    keys += [f"stages[{i}]" for i in range(max(len(old), len(new)))
             if (old[i] if i < len(old) else None) != (new[i] if i < len(new) else None)]
    return keys


def _claim(out_dir: Path, recipe: Recipe, main: bool) -> None:
    """Write ``stages.json``, or refuse a folder written by another stage list or other settings."""
    record = out_dir / "stages.json"
    mine = _stage_list_hash(recipe)
    if record.is_file():
        try:
            theirs = json.loads(record.read_text())
        except ValueError:
            raise CheckpointError(f"{record} is not valid JSON: restore it, or use another checkpoint.output_dir") from None
        if "recipe" in theirs:
            changed = _changed_keys(theirs["recipe"], mine["recipe"])
        else:  # written by an older version: only its hash to go by
            changed = [] if theirs.get("hash") == mine["hash"] else ["(unknown: stages.json has no recipe)"]
        if changed:
            shown = ", ".join(changed[:6]) + (f" (+{len(changed) - 6} more)" if len(changed) > 6 else "")
            raise CheckpointError(
                f"{out_dir} was written by a different multi-stage recipe (stages {theirs.get('stages')}, now "
                f"{mine['stages']}; changed: {shown}): use another checkpoint.output_dir, or restore the recipe")
        return
    if recipe.checkpoint.resume == "none" and any(out_dir.glob("stage-*")):
        raise SpecError(f"{out_dir} already holds stages; continue with checkpoint.resume=auto or use another output_dir")
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_json(record, mine)


def train_stages(recipe: Recipe, *, callbacks: Sequence["TrainCallback"] = ()) -> "TrainResult":
    """Run every stage in order (skipping finished ones); the last stage's result, with ``stages`` set."""
    from retrofit.train.distributed import world_from_env
    from retrofit.train.loop import run_recipe

    from retrofit.train.loop import quiet

    stages = stage_recipes(recipe)
    rank, _ = world_from_env()
    out_dir = Path(recipe.checkpoint.output_dir).expanduser().resolve()
    _claim(out_dir, recipe, rank == 0)
    finished = _finished_stages(out_dir, stages)
    say = (lambda msg: print(msg, flush=True)) if rank == 0 and not quiet() else (lambda msg: None)
    results: list[dict] = []
    last = None
    previous_id = None
    for i, (folder, sub) in enumerate(stages, start=1):
        if i <= finished:
            say(f"[retrofit] stage {i}/{len(stages)} ({folder}) is finished; skipping it")
            results.append(_read_done(out_dir / folder / "DONE"))
            previous_id = results[-1].get("id")
            continue
        say(f"[retrofit] stage {i}/{len(stages)}: {folder} (objective {sub.train.objective})")
        result = last = run_recipe(sub, callbacks=callbacks)
        summary = {"stage": folder, "steps": result.steps, "tokens": result.tokens,
                   "final_dir": str(result.final_dir) if result.final_dir else None,
                   "evals": result.evals, "id": secrets.token_hex(8), "input": previous_id}
        if rank == 0:
            _write_json(out_dir / folder / "DONE", summary)
        results.append(summary)
        previous_id = summary["id"]
    if finished == len(stages):  # every stage was already finished: the result is the last stage's
        from retrofit.train.loop import TrainResult
        from retrofit.train.trainable import ParameterCounts

        s = results[-1]
        last = TrainResult(out_dir / stages[-1][0], Path(s["final_dir"]) if s.get("final_dir") else None,
                           int(s["steps"]), int(s["tokens"]), ParameterCounts(0, 0), None, [], list(s.get("evals", [])))
    last.stages = results
    if rank == 0 and last.final_dir is not None:
        _link_final(out_dir, Path(last.final_dir))
    return last


def _link_final(out_dir: Path, final_dir: Path) -> None:
    """Point ``OUTPUT_DIR/final`` at the last stage's ``final/`` (a relative link, replaced atomically;
    a real folder of that name, which no staged run writes, is left alone)."""
    link = out_dir / "final"
    if not link.exists() or link.is_symlink():
        symlink_atomic(link, os.path.relpath(final_dir, out_dir))


def _read_done(done: Path) -> dict:
    try:
        data = json.loads(done.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{done} is not valid JSON: delete it to run that stage again") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{done} is not a stage record: delete it to run that stage again")
    return data


def _is_done(folder: Path, sub: Recipe) -> bool:
    return (folder / "DONE").is_file() and ((folder / "final").is_dir() or not sub.checkpoint.export)


def _finished_stages(out_dir: Path, stages: list[tuple[str, Recipe]]) -> int:
    """How many leading stages are finished and chained (each trained on its predecessor's current output).

    Refuses a run that would re-run a stage while a later stage holds work built on its former
    output (the later stage would be skipped or resumed on stale input), and a finished stage
    whose recorded input is not its predecessor's current output.
    """
    count, previous_id = 0, None
    for i, (folder, sub) in enumerate(stages):
        if not _is_done(out_dir / folder, sub):
            break
        done = _read_done(out_dir / folder / "DONE")
        if i > 0 and "input" in done and done["input"] != previous_id:
            raise CheckpointError(f"{out_dir / folder} was trained on an earlier output of {stages[i - 1][0]}, which "
                                  f"has run again since: delete {out_dir / folder} (and the stages after it) to train "
                                  "it on the current one")
        count, previous_id = i + 1, done.get("id")
    stale = [folder for folder, _ in stages[count + 1:] if (out_dir / folder).is_dir() and any((out_dir / folder).iterdir())]
    if stale:
        rerun = stages[count][0]
        raise CheckpointError(f"{rerun} is not finished (no DONE) and would run again, but {', '.join(stale)} "
                              f"already hold{'s' if len(stale) == 1 else ''} work trained on its former output: delete "
                              f"{', '.join(str(out_dir / f) for f in stale)} to retrain them on the new one, or "
                              f"restore {out_dir / rerun / 'DONE'}")
    return count
