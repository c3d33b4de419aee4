"""Where training metrics go (rank 0 only): ``metrics.jsonl``, TensorBoard, optionally W&B.

``metrics.jsonl`` holds one JSON object per logged step (``kind`` = ``train`` or ``eval``), an
:class:`retrofit.fs.AppendLog` appended across resumes: a resumed run first drops the lines past
its checkpoint's step (a run that starts afresh, all of them), so the file reads as one
uninterrupted run with no step twice; the trainer syncs it before publishing each checkpoint, so
no line a checkpoint has seen is lost; a line torn by a kill is no line.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from retrofit.errors import SpecError
from retrofit.fs.atomic import AppendLog, write_text_atomic

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
    for line in AppendLog(path).records():
        if line.strip():
            row = json.loads(line)
            if kind is None or row.get("kind") == kind:
                rows.append(row)
    return rows


class MetricsLogger:
    """Fan-out of ``log(kind, step, metrics)`` to the sinks a recipe asks for.

    ``resume_step`` is the step of the checkpoint the run resumes from (``None``: a fresh start).
    """

    def __init__(self, output_dir: Path, *, enabled: bool, tensorboard: bool, wandb: bool, wandb_project: str,
                 run_name: str, config: dict, resume_step: int | None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._log = AppendLog(self.path)
        self._tb = self._wandb = None
        if not enabled:
            return
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
            run_id = id_file.read_text().strip() if id_file.is_file() else ""
            if not run_id:
                run_id = wb.util.generate_id()
                write_text_atomic(id_file, run_id + "\n")
            self._wandb = wb.init(project=wandb_project, name=run_name, id=run_id, resume="allow",
                                  config=flatten(config), dir=str(output_dir))

    def _truncate_after(self, step: int | None) -> None:
        """Keep the records up to ``step`` (``None``: none): the steps this run logs again go."""
        self._log.retain(lambda line: step is not None and bool(line.strip()) and json.loads(line).get("step", 0) <= step)

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._log.append(json.dumps({"kind": kind, "step": step, **metrics}))
        scalars = {f"{kind}/{k}": v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def sync(self) -> None:
        """Make every record logged so far durable (before a checkpoint that has seen them is published)."""
        if self.enabled:
            self._log.sync()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
