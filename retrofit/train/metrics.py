"""Where training metrics go (rank 0 only): ``metrics.jsonl``, TensorBoard, optionally W&B.

``metrics.jsonl`` holds one JSON object per logged step (``kind`` = ``train`` or ``eval``) and
is appended across resumes; a resumed run first drops lines past its checkpoint's step so
the file reads as one uninterrupted run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from retrofit.errors import SpecError

__all__ = ["MetricsLogger", "flatten", "read_metrics"]


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> ``{"a.b": scalar-or-str}`` (lists become strings), for hparam tables."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif v is None or isinstance(v, (list, tuple)):
            out[key] = str(v)
        else:
            out[key] = v
    return out


def read_metrics(path: Path, kind: str | None = None) -> list[dict]:
    """The records of a ``metrics.jsonl`` (optionally only one ``kind``)."""
    rows = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if kind is None or row.get("kind") == kind:
                    rows.append(row)
    return rows


class MetricsLogger:
    """Fan-out of ``log(kind, step, metrics)`` to the sinks a recipe asks for."""

    def __init__(self, output_dir: Path, *, enabled: bool, tensorboard: bool, wandb: bool, wandb_project: str,
                 run_name: str, config: dict, resume_step: int | None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = self._wandb = None
        if not enabled:
            return
        if resume_step is not None:
            self._truncate_after(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"), purge_step=resume_step)
            self._tb.add_text("recipe", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                raise SpecError("logging.wandb=true needs the wandb package: pip install wandb") from None
            id_file = Path(output_dir) / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else wb.util.generate_id()
            id_file.write_text(run_id + "\n")
            self._wandb = wb.init(project=wandb_project, name=run_name, id=run_id, resume="allow",
                                  config=flatten(config), dir=str(output_dir))

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"kind": kind, "step": step, **metrics}
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        scalars = {f"{kind}/{k}": v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
