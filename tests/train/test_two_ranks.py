"""Two data-parallel DeepSpeed ranks on the CPU (torchrun + gloo): same trainable weights on both ranks."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from retrofit import load
from retrofit.train.checkpointing import list_checkpoints, read_state
from tests.train import tiny

REPO = Path(__file__).resolve().parents[2]

RANK_SCRIPT = """
import json, os, sys
import torch
from retrofit.train import TrainCallback, train
from retrofit.train.recipe import recipe_from_dict

class Keep(TrainCallback):
    def on_train_begin(self, model):
        self.model = model

keep = Keep()
result = train(recipe_from_dict(json.loads(open(sys.argv[1]).read())), callbacks=[keep])
rank = int(os.environ["RANK"])
trained = {n: p.detach().clone() for n, p in keep.model.named_parameters() if p.requires_grad}
torch.save({"trained": trained, "losses": [h["loss"] for h in result.history], "lrs": [h["lr"] for h in result.history]},
           f"{sys.argv[2]}/rank{rank}.pt")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(recipe: dict, tmp_path: Path) -> tuple[dict, dict]:
    spec = tmp_path / "recipe.json"
    spec.write_text(json.dumps(recipe))
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(script), str(spec), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return tuple(torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))


def test_two_ranks_hold_identical_trainable_weights(converted_dir, books, tmp_path):
    out = tmp_path / "run"
    # batch 4 = micro 2 x 2 ranks x 1 accumulation step
    recipe = tiny.recipe_dict(converted_dir, books, out, train={"max_steps": 3, "gradient_checkpointing": False},
                              checkpoint={"save_every": 3}, eval={"sequences": 0})
    r0, r1 = _run_two_ranks(recipe, tmp_path)
    assert set(r0["trained"]) == set(r1["trained"]) and r0["trained"]
    assert all(torch.equal(r0["trained"][k], r1["trained"][k]) for k in r0["trained"])
    start = dict(load(converted_dir).named_parameters())
    assert all(not torch.equal(start[k], v) for k, v in r0["trained"].items())  # and they did train
    assert r0["losses"] == r1["losses"]  # both log the all-reduced mean

    [(step, ckpt)] = list_checkpoints(out)
    assert step == 3 and read_state(ckpt)["world_size"] == 2
    assert all((ckpt / f"data_state_rank{r}.json").is_file() for r in (0, 1))  # each rank's own data position
    # (that the ranks' sequences are disjoint is tests/data/test_packing.py's job, on the same sharding code)


def test_two_ranks_spend_a_time_budget_on_one_clock(converted_dir, books, tmp_path):
    """train.max_time: both ranks stop after the same step with the same LRs, and the stop is saved."""
    out = tmp_path / "run"
    recipe = tiny.recipe_dict(converted_dir, books, out, eval={"sequences": 0}, checkpoint={"save_every": 100},
                              train={"max_steps": 50, "max_time": 1e-3, "warmup_steps": 0, "gradient_checkpointing": False})
    r0, r1 = _run_two_ranks(recipe, tmp_path)
    assert len(r0["losses"]) == len(r1["losses"]) == 1  # any real step spends a millisecond
    assert r0["lrs"] == r1["lrs"] and r0["losses"] == r1["losses"]
    assert [s for s, _ in list_checkpoints(out)] == [1]
