"""Multi-stage recipes: attention transfer, then KL, then (optionally) LoRA, from one YAML.

A recipe with a ``stages:`` list runs each stage as a recipe of its own: the stage's keys are
merged over the recipe's (a partial recipe; ``name`` names the stage), and stage ``i + 1``
starts from the model stage ``i`` exported. Every stage writes into
``OUTPUT_DIR/stage-<i>-<name>/`` (checkpoints, metrics, ``final/``); the last stage's
``final/`` is the result, also linked from ``OUTPUT_DIR/final`` as a copy-free pointer file.

    stages:
      - {name: transfer, train: {objective: attention, max_steps: 300, lr: 3e-3}}
      - {name: kl, train: {objective: kl, max_steps: 50, lr: 1e-3}}

Resume (``checkpoint.resume: auto``) continues inside whichever stage was running; finished
stages (their ``DONE`` marker) are skipped. ``OUTPUT_DIR/stages.json`` records the stage list:
a run with a different list refuses to continue the folder.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from retrofit.errors import CheckpointError, SpecError
from retrofit.fs.atomic import write_json_atomic
from retrofit.train.recipe import Recipe, stage_name, stage_recipes

if TYPE_CHECKING:
    from retrofit.train.loop import TrainCallback, TrainResult

__all__ = ["stage_recipes", "train_stages"]

def _write_json(path: Path, data: dict) -> None:
    write_json_atomic(path, data, indent=1, default=str)


def _stage_list_hash(recipe: Recipe) -> dict:
    data = recipe.to_dict()
    data["checkpoint"].pop("resume", None)
    data["logging"] = {}
    text = json.dumps(data, sort_keys=True, default=str)
    return {"hash": hashlib.sha256(text.encode()).hexdigest()[:16],
            "stages": [stage_name(i, s) for i, s in enumerate(recipe.stages, start=1)]}


def _claim(out_dir: Path, recipe: Recipe, main: bool) -> None:
    """Write ``stages.json``, or refuse a folder written by another stage list."""
    record = out_dir / "stages.json"
    mine = _stage_list_hash(recipe)
    if record.is_file():
        theirs = json.loads(record.read_text())
        if theirs.get("hash") != mine["hash"]:
            raise CheckpointError(
                f"{out_dir} was written by a different multi-stage recipe (stages {theirs.get('stages')}, now "
                f"{mine['stages']}, or other keys changed): use another checkpoint.output_dir, or restore the recipe")
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

    stages = stage_recipes(recipe)
    rank, _ = world_from_env()
    out_dir = Path(recipe.checkpoint.output_dir).expanduser().resolve()
    _claim(out_dir, recipe, rank == 0)
    results: list[dict] = []
    last = None
    for i, (folder, sub) in enumerate(stages, start=1):
        done = out_dir / folder / "DONE"
        final = out_dir / folder / "final"
        if done.is_file() and (final.is_dir() or not sub.checkpoint.export):
            if rank == 0:
                print(f"[retrofit] stage {i}/{len(stages)} ({folder}) is finished; skipping it", flush=True)
            results.append(json.loads(done.read_text()))
            continue
        if rank == 0:
            print(f"[retrofit] stage {i}/{len(stages)}: {folder} (objective {sub.train.objective})", flush=True)
        result = last = run_recipe(sub, callbacks=callbacks)
        summary = {"stage": folder, "steps": result.steps, "tokens": result.tokens,
                   "final_dir": str(result.final_dir) if result.final_dir else None,
                   "evals": result.evals}
        if rank == 0:
            _write_json(done, summary)
        results.append(summary)
    if last is None:  # every stage was already finished
        from retrofit.train.loop import TrainResult
        from retrofit.train.trainable import ParameterCounts

        s = results[-1]
        last = TrainResult(out_dir / stages[-1][0], Path(s["final_dir"]) if s.get("final_dir") else None,
                           int(s["steps"]), int(s["tokens"]), ParameterCounts(0, 0), None, [], list(s.get("evals", [])))
    last.stages = results
    return last
