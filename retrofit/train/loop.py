"""Continual pretraining of a converted model: accelerate driving a DeepSpeed engine.

One optimizer step = ``grad_accum`` micro-steps of ``micro_batch_size`` packed sequences on
every data-parallel rank (``batch_size`` sequences in all). Per step: set the LR from the
schedule, forward/backward each micro-batch (DeepSpeed reduces gradients, clips and steps the
optimizer at the accumulation boundary), check the loss and gradient norm are finite, log,
and evaluate / checkpoint when due. The optimizer is built from the trainable parameters only.

Checkpoints (see :mod:`retrofit.train.checkpointing`) hold the trainable weights, optimizer,
RNG and data position of every rank, so ``checkpoint.resume=auto`` continues the same
trajectory: the resumed run's losses and weights equal an uninterrupted run's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from retrofit.errors import CheckpointError, DataError, RetrofitError, SpecError, TrainingError
from retrofit.fs.atomic import atomic_file, write_text_atomic
from retrofit.fs.write_errors import free_space, write_failure
from retrofit.train import checkpointing as ckpt
from retrofit.train.distributed import (
    deepspeed_config,
    grad_accum_steps,
    no_shared_memory_comm,
    resolve_precision,
    single_process_env,
    world_from_env,
)
from retrofit.train.memory import check_step_fits, is_out_of_memory, memory_advice
from retrofit.train.metrics import MetricsLogger
from retrofit.train.objectives import heldout_nll
from retrofit.train.recipe import Recipe
from retrofit.train.schedule import lr_at
from retrofit.train.trainable import ParameterCounts, apply_trainable, count_parameters
from retrofit.train.window_dropout import dropout_layers, set_window_dropout, window_dropout_at

__all__ = ["run_recipe", "TrainCallback", "TrainResult", "total_steps"]


class TrainCallback:
    """Hooks into a run (all ranks call them). Subclass and override what you need."""

    def on_train_begin(self, model: torch.nn.Module) -> None:
        """Before the first step, with the (unwrapped) model being trained."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """After optimizer step ``step`` (1-based) with ``loss``, ``lr``, ``grad_norm``, ``tokens``."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """After a held-out evaluation at ``step`` (0 = before training)."""

    def on_save(self, step: int, path: Path) -> None:
        """After checkpoint ``path`` is complete (renamed into place)."""


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path | None
    steps: int
    tokens: int
    counts: ParameterCounts
    resumed_from: Path | None = None
    history: list[dict] = field(default_factory=list)  # this process's per-step metrics
    evals: list[dict] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # multi-stage recipes: one summary per stage


def _spans(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out) or "none"


def total_steps(recipe: Recipe) -> int:
    """Optimizer steps: ``max_steps``, or fewer if ``max_tokens`` is reached first."""
    t = recipe.train
    steps = [t.max_steps] if t.max_steps is not None else []
    if t.max_tokens is not None:
        steps.append(math.ceil(t.max_tokens / (t.batch_size * recipe.data.seq_len)))
    return int(min(steps))


def quiet() -> bool:
    """Whether info lines are off: ``-q`` sets the ``retrofit`` logger to WARNING (unset: not quiet)."""
    return logging.getLogger("retrofit").level > logging.INFO


def _fingerprint(recipe: Recipe) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint.

    Settings at their defaults (recall off, recall's ``answer_weight`` 1.0 and ``style`` "facts", the
    ``lm`` objective, ``data.document_boundaries`` on) stay out of the hashed mapping: that is the hash every checkpoint of this version
    carries, so leaving them in would refuse to resume those checkpoints."""
    d = recipe.to_dict()
    data_keys = {k: d["data"][k] for k in ("dataset", "dataset_config", "split", "text_field", "files", "holdout_last",
                                           "strip_gutenberg", "bos_every_sequence", "seq_len", "shuffle_buffer", "seed")}
    same = {"model": d["model"]["name"], "conversion": d["conversion"], "trainable": d["trainable"], "data": data_keys,
            "batch_size": d["train"]["batch_size"], "micro_batch_size": d["train"]["micro_batch_size"]}
    if not d["data"].get("document_boundaries", True):  # on: the hash of checkpoints written before the key
        data_keys["document_boundaries"] = False
    if d["data"]["recall"]["share"]:
        data_keys["recall"] = dict(d["data"]["recall"])
        for key, default in (("answer_weight", 1.0), ("style", "facts")):
            if data_keys["recall"].get(key) == default:
                del data_keys["recall"][key]
    if d["train"]["objective"] != "lm":
        same["objective"] = {"objective": d["train"]["objective"], "weights": d["train"]["objective_weights"]}
        if d["train"].get("head_positions"):
            same["objective"]["head_positions"] = d["train"]["head_positions"]
    return {"hash": hashlib.sha256(json.dumps(same, sort_keys=True, default=str).encode()).hexdigest()[:16], **same}


# ----------------------------------------------------------------------------- data state files
def _save_data_state(state: dict, folder: Path, rank: int) -> None:
    arrays = {"carry": state["carry"], "pool": state["pool"]}
    meta = {k: v for k, v in state.items() if k not in arrays}
    meta["rng"] = [meta["rng"][0], list(meta["rng"][1]), meta["rng"][2]]
    with atomic_file(folder / f"data_state_rank{rank}.npz", "wb") as fh:
        np.savez(fh, **arrays)
    write_text_atomic(folder / f"data_state_rank{rank}.json", json.dumps(meta))


def _load_data_state(folder: Path, rank: int) -> dict:
    meta_file, arr_file = folder / f"data_state_rank{rank}.json", folder / f"data_state_rank{rank}.npz"
    if not meta_file.is_file() or not arr_file.is_file():
        raise CheckpointError(f"{folder} has no data state for rank {rank}: was it written with another number of ranks?")
    try:
        meta = json.loads(meta_file.read_text())
        meta["rng"] = (meta["rng"][0], tuple(meta["rng"][1]), meta["rng"][2])
        with np.load(arr_file, allow_pickle=False) as arrays:
            meta.update(carry=arrays["carry"], pool=arrays["pool"])
    except (OSError, ValueError, KeyError, TypeError, IndexError, EOFError, zipfile.BadZipFile) as exc:
        what = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{folder}: its data position (data_state_rank{rank}.json/.npz) is damaged ({what}); "
                              "resume from an earlier checkpoint (checkpoint.resume=PATH) or delete this one") from None
    return meta


# ----------------------------------------------------------------------------- the run
class _Run:
    def __init__(self, recipe: Recipe, callbacks: Sequence[TrainCallback]):
        self.recipe = recipe
        self.callbacks = list(callbacks)
        self.rank, self.world = world_from_env()
        self.main = self.rank == 0
        self.cuda = torch.cuda.is_available()
        self.output_dir = Path(recipe.checkpoint.output_dir).expanduser().resolve()
        self.total_steps = total_steps(recipe)
        self.accum = grad_accum_steps(recipe, self.world)
        self.step = 0
        self.tokens = 0
        self.train_seconds = 0.0  # time spent in training steps, all resumes together (train.max_time)
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.last_saved: Path | None = None
        self.logger: MetricsLogger | None = None
        self.resources = contextlib.ExitStack()  # the output folder's lock; closed by train()

    def log(self, msg: str) -> None:
        """Print an info line on rank 0 (with ``-q`` only notes and warnings)."""
        if self.main and (not quiet() or "note:" in msg or "warning" in msg.lower()):
            print(msg, flush=True)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed

        from retrofit.fs import check_output_folder, check_replaceable, output_lock
        from retrofit.train.data import data_files
        from retrofit.train.data_checks import check_decodable, check_heldout
        from retrofit.train.data_digest import data_digest

        r = self.recipe
        self.files = data_files(r)  # a bad data path fails here, before any model loads
        self.data_digest = data_digest(self.files, r.base_dir)  # what a resume checks its data against
        check_decodable(r, self.files)  # and so does undecodable text
        check_heldout(r, self.files)  # and held-out files with no text in them
        check_output_folder(self.output_dir, "checkpoint.output_dir")
        if r.checkpoint.export:  # the export replaces these at the end: refuse a folder it may not replace now
            for name in ("final", "adapter", "adapter-base"):
                if (self.output_dir / name).exists():
                    check_replaceable(self.output_dir / name, overwrite=True)
        if self.main:  # one run per output folder: a second one fails here, before touching it
            self.resources.enter_context(output_lock(self.output_dir))
        self.precision = resolve_precision(r.train.precision, self.cuda)
        ds_cfg = deepspeed_config(r, world_size=self.world, precision=self.precision, cuda=self.cuda)
        self.zero_stage = int(ds_cfg["zero_optimization"].get("stage", 0))
        handlers = [] if self.cuda else [InitProcessGroupKwargs(backend="gloo")]
        with no_shared_memory_comm(self.world):  # one rank: no C++ build of a collective it never uses
            self.acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_cfg), kwargs_handlers=handlers,
                                   gradient_accumulation_steps=self.accum)
        if self.acc.num_processes != self.world:
            raise TrainingError(f"accelerate sees {self.acc.num_processes} processes but the launcher started {self.world}")
        self.device = self.acc.device
        set_seed(r.train.seed)

        self.resume_from = self._find_resume()
        if self.resume_from is not None:
            self._check_data(self.resume_from, ckpt.read_state(self.resume_from))  # before any model loads
        self._build_model()
        self._build_data()
        self.log(self._summary())
        if self.resume_from is not None:
            self._restore(self.resume_from)
        if self.main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            import yaml

            write_text_atomic(self.output_dir / "recipe.yaml",
                              yaml.safe_dump({**r.to_dict(), "base_dir": r.base_dir}, sort_keys=False))
            self.logger = MetricsLogger(
                self.output_dir, enabled=True, tensorboard=r.logging.tensorboard, wandb=r.logging.wandb,
                wandb_project=r.logging.wandb_project, run_name=r.logging.run_name or self.output_dir.name,
                config=r.to_dict(), resume_step=self.step if self.resume_from else None,
            )

    def _find_resume(self) -> Path | None:
        c = self.recipe.checkpoint
        if self.main:
            ckpt.clean_stale(self.output_dir)
        self.acc.wait_for_everyone()
        latest = ckpt.latest_checkpoint(self.output_dir)
        if c.resume == "none":
            if latest is not None:
                raise SpecError(f"{self.output_dir} already holds checkpoints (newest: {latest.name}); continue it with "
                                "checkpoint.resume=auto or choose another checkpoint.output_dir")
            return None
        if c.resume == "auto":
            return latest
        path = Path(c.resume).expanduser()
        ckpt.read_state(path)  # CheckpointError unless complete
        return path.resolve()

    def _build_model(self) -> None:
        from retrofit.surgery import new_parameter_names
        from retrofit.train.model import build_model, model_dtype

        r = self.recipe
        model, self.tokenizer = build_model(r, dtype=model_dtype(r, self.cuda), log=self.log)
        self.use_cache = getattr(model.config, "use_cache", True)  # restored in the exported config
        model.config.use_cache = False
        new = new_parameter_names(model)
        from retrofit.train.objectives import Objective, layer_weights, objective_weights

        per_layer = layer_weights(r.train.layer_weights)
        self.objective = Objective(objective_weights(r.train.objective, r.train.objective_weights),
                                   head_positions=r.train.head_positions, layer_weights=per_layer,
                                   answer_weight=r.data.recall.answer_weight, weights_queries=r.train.weights_queries)
        if per_layer:
            from retrofit.surgery.distill import converted_modules

            converted = {int(m.layer_idx) for m in converted_modules(model)}
            unknown = sorted(set(per_layer) - converted)
            if unknown:
                raise SpecError(f"train.layer_weights names layer(s) {', '.join(map(str, unknown))}, which "
                                f"{r.model.name} does not have converted (converted: {_spans(sorted(converted))})")

        from retrofit.surgery import retrofit_record
        from retrofit.surgery.fingerprint import section_digest, tokenizer_digest, weights_fingerprint
        from retrofit.train.data_checks import check_positions

        self.section_digest = section_digest(retrofit_record(model) or {})
        self.tokenizer_digest = tokenizer_digest(self.tokenizer)
        model = apply_trainable(model, r.trainable.mode, new, lora=dataclasses.asdict(r.trainable.lora),
                                extra=r.trainable.extra)
        # the frozen base weights, recorded in every checkpoint and checked on resume
        self.base_fingerprint = weights_fingerprint(model, [n for n, p in model.named_parameters() if not p.requires_grad])
        self.counts = count_parameters(model)
        self.dropout_layers = dropout_layers(model) if r.train.window_dropout > 0 else []
        if r.train.window_dropout > 0 and not self.dropout_layers:
            raise SpecError(f"train.window_dropout={r.train.window_dropout} drops the sliding-window branch of "
                            f"converted layers, but {r.model.name} has no converted layer with a window branch to drop "
                            "(set train.window_dropout=0, or convert with a method that has one: macchiato with "
                            "latents > 0)")
        if "attention" in self.objective.weights:
            from retrofit.surgery.distill import converted_modules

            if not any(p.requires_grad for m in converted_modules(model) for p in m.parameters()):
                raise SpecError(f"train.objective={r.train.objective} trains converted layers against their original "
                                "attention, but nothing inside a converted layer is trainable (exp-linear adds no "
                                "weights: use trainable.mode lora or attention)")
        if "weights" in self.objective.weights:
            from retrofit.surgery.distill import converted_modules

            lacking = sorted({m.method for m in converted_modules(model) if not m.supports("attention_weights")})
            if lacking:
                raise SpecError(f"train.objective's weights term distils a layer's attention weights, which the converted "
                                f"layers of method(s) {', '.join(lacking)} do not expose as one distribution (method "
                                "hedgehog does): use objective attention or kl")
        distilled = sorted({"attention", "weights"} & set(self.objective.weights))
        if r.train.gradient_checkpointing and distilled:
            # the transfer pass keeps a graph only through the new weights of converted layers;
            # recomputing a decoder layer in backward would run it outside the transfer mode
            self.log(f"[retrofit] note: gradient checkpointing is off for the {' and '.join(distilled)} objective "
                     "(nothing to save)")
        elif r.train.gradient_checkpointing:
            from retrofit.surgery.recompute import set_activation_checkpointing

            set_activation_checkpointing(model, True)
        act_bytes = 2 if self.precision == "bf16" else 4
        reserved = 0
        if self.cuda and self.zero_stage < 3:
            reserved = sum(p.numel() for p in model.parameters()) * act_bytes
        check_step_fits(model.config, micro_batch_size=r.train.micro_batch_size, seq_len=r.data.seq_len,
                        act_bytes=act_bytes, device=self.device, reserved=reserved)
        check_positions(r, model.config)  # after the memory check: an impossible length is reported as such
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [g for g in ({"params": decay, "weight_decay": r.train.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        optimizer = torch.optim.AdamW(groups, lr=r.train.lr, betas=tuple(r.train.betas), eps=r.train.eps)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        self.engine = self.model  # the DeepSpeedEngine

    def _build_data(self) -> None:
        from retrofit.train.data import heldout_sequences, recipe_tokenize, train_stream
        from retrofit.train.data_checks import check_enough_tokens

        check_enough_tokens(self.recipe, recipe_tokenize(self.recipe, self.tokenizer), self.files, self.rank, self.world)
        self.train_data, self.data_desc = train_stream(self.recipe, self.tokenizer, self.files, self.rank, self.world)
        self.eval_data, self.eval_desc = heldout_sequences(self.recipe, self.tokenizer, self.files)
        if self.files.held_out and self.recipe.eval.sequences and not self.eval_data:
            raise DataError(f"the held-out (eval) files ({self.eval_desc}) hold fewer than data.seq_len="
                            f"{self.recipe.data.seq_len} tokens, so no held-out loss could be measured: add text, "
                            "lower data.seq_len, or set eval.sequences=0 to train without a held-out loss")

    def _summary(self) -> str:
        r, t = self.recipe, self.recipe.train
        tok_step = t.batch_size * r.data.seq_len
        lines = [
            f"[retrofit] model {r.model.name}: {self.counts} (mode {r.trainable.mode})",
            f"[retrofit] {self.world} rank(s) on {self.device.type}, DeepSpeed ZeRO-{self.zero_stage}, {self.precision}, "
            f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}",
            f"[retrofit] batch {t.batch_size} x {r.data.seq_len} tokens = {tok_step:,} tokens/step "
            f"(micro {t.micro_batch_size} x {self.world} ranks x {self.accum} accumulation); "
            f"{self.total_steps:,} steps = {self.total_steps * tok_step:,} tokens"
            + (f", or fewer if train.max_time ({t.max_time:g} s) is spent first" if t.max_time else ""),
            f"[retrofit] objective {self.objective.name}; lr {t.lr:g}, warmup {t.warmup_steps}, {t.schedule} to "
            f"{t.min_lr_ratio:g} x lr, clip {t.grad_clip:g}"
            + (f"; window dropout {t.window_dropout:g} -> 0 over {t.window_dropout_until:.0%} of the steps "
               f"({len(self.dropout_layers)} layers)" if self.dropout_layers else ""),
            f"[retrofit] data: {self.data_desc}; eval: {len(self.eval_data)} sequences from {self.eval_desc}",
            f"[retrofit] output: {self.output_dir}" + (f" (resuming from {self.resume_from.name})" if self.resume_from else ""),
        ]
        return "\n".join(lines)

    def _restore(self, folder: Path) -> None:
        state = ckpt.read_state(folder)
        if int(state.get("world_size", -1)) != self.world:
            raise CheckpointError(f"{folder} was written by {state.get('world_size')} ranks, this run has {self.world}: "
                                  "resume with the same number of ranks (or start fresh with checkpoint.resume=none "
                                  "and another output_dir)")
        mine = _fingerprint(self.recipe)
        if state.get("fingerprint", {}).get("hash") != mine["hash"]:
            theirs = state.get("fingerprint", {})
            diff = [k for k in mine if k != "hash" and theirs.get(k) != mine[k]]
            raise CheckpointError(f"{folder} was written by a different recipe (differs in: {', '.join(diff)}); "
                                  "resume with the same model, conversion, trainable set, data and batch, or use "
                                  "another checkpoint.output_dir")
        self._check_identity(folder, state)
        if int(state.get("total_steps", self.total_steps)) != self.total_steps:
            self.log(f"[retrofit] note: the run was planned for {state['total_steps']} steps, now {self.total_steps}: "
                     "the LR schedule after the resume point follows the new length")
        from retrofit.train.safe_load import check_random_states, weights_only_loads

        check_random_states(folder, self.rank)  # accelerate swallows a refused RNG file and resumes without it
        with weights_only_loads():  # DeepSpeed/accelerate pickles: tensors and plain data only, never code
            self.acc.load_state(str(folder), load_module_strict=False)
        self.train_data.load_state_dict(_load_data_state(folder, self.rank))
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.last_saved = folder

    def _check_data(self, folder: Path, state: dict) -> None:
        """The local data files are those the checkpoint was trained on: the same list, sizes and content."""
        from retrofit.train.data_digest import compare_data_digests

        fresh = "start fresh in another checkpoint.output_dir (or delete its checkpoints)"
        recorded = state.get("data_digest")
        if not isinstance(recorded, dict):
            raise CheckpointError(f"{folder / ckpt.STATE_FILE} has no data digest (data_digest): it was edited or "
                                  "written by an older version, so this run cannot tell whether its data files are the "
                                  f"same; {fresh}")
        why = compare_data_digests(recorded, self.data_digest)
        if why:
            raise CheckpointError(f"{folder} was trained on other data: {why}; resume with the data files as they "
                                  f"were, or {fresh}")

    def _check_identity(self, folder: Path, state: dict) -> None:
        """The checkpoint was written for this retrofit section, tokenizer and base weights."""
        for key, what in (("section_digest", "retrofit section digest"), ("tokenizer_digest", "tokenizer digest"),
                          ("base_fingerprint", "base fingerprint")):
            if not state.get(key):
                raise CheckpointError(f"{folder / ckpt.STATE_FILE} has no {what} ({key}): it was edited or written "
                                      "by an older version, so this run cannot tell whether the model is the same; "
                                      "start fresh in another checkpoint.output_dir")
        if state["section_digest"] != self.section_digest:
            raise CheckpointError(f"{folder} was written for another retrofit section (digest {state['section_digest']}, "
                                  f"this model's is {self.section_digest}): the converted model's config.json was "
                                  "edited; restore it or start fresh in another checkpoint.output_dir")
        recorded_tok = state["tokenizer_digest"]
        if recorded_tok != self.tokenizer_digest:
            raise CheckpointError(f"{folder} was trained with another tokenizer than {self.recipe.model.name} holds now "
                                  f"(digest {recorded_tok} recorded, {self.tokenizer_digest} now): the same text would "
                                  "become other token ids; restore the original tokenizer files, or start fresh in "
                                  "another checkpoint.output_dir")
        from retrofit.surgery.fingerprint import compare_fingerprints, unreadable_format

        unreadable = unreadable_format(state["base_fingerprint"])
        if unreadable:
            raise CheckpointError(f"{folder / ckpt.STATE_FILE}: {unreadable}; this run cannot resume from it: start "
                                  "fresh in another checkpoint.output_dir")
        why = compare_fingerprints(state.get("base_fingerprint"), self.base_fingerprint)
        if why:
            raise CheckpointError(f"{folder} was trained on other base weights than {self.recipe.model.name} holds now "
                                  f"({why}): resume with the original base model, or start fresh in another "
                                  "checkpoint.output_dir")

    # ------------------------------------------------------------------ pieces of a step
    def _set_lr(self) -> float:
        t = self.recipe.train
        lr = lr_at(self.step, lr=t.lr, warmup_steps=t.warmup_steps, total_steps=self.total_steps,
                   schedule=t.schedule, min_lr_ratio=t.min_lr_ratio, time_fraction=self._time_fraction())
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(ids (B, T), answer mask (B, T) or None, position ids (B, T) or None)``: a stream of
        ``(ids, mask)`` items (recall answers marked for the objective,
        :class:`retrofit.train.data.RecallSequences`) gives the mask; ``data.document_boundaries``
        gives positions that restart at each document (a recall-rewritten row is one document)."""
        rows, whole = [], []
        for _ in range(self.recipe.train.micro_batch_size):
            rows.append(next(self._train_iter))
            whole.append(bool(getattr(self.train_data, "rewritten", False)))
        mask = None
        if isinstance(rows[0], tuple):
            rows, mask = [r[0] for r in rows], torch.stack([r[1] for r in rows]).to(self.device)
        ids = torch.stack(rows)
        return ids.to(self.device), mask, self._positions(ids, whole)

    def _positions(self, ids: torch.Tensor, whole: Sequence[bool] = ()) -> torch.Tensor | None:
        """Position ids restarting at each packed document of ``ids`` (None: boundaries off or none)."""
        if not self.recipe.data.document_boundaries:
            return None
        from retrofit.train.data import batch_positions

        positions = batch_positions(ids, self.tokenizer.eos_token_id, whole)
        return None if positions is None else positions.to(self.device)

    def _global_mean(self, value: torch.Tensor) -> float:
        v = value.detach().float().reshape(1).to(self.device)
        if self.world > 1:
            torch.distributed.all_reduce(v)
            v /= self.world
        return float(v.item())

    def _stop_non_finite(self, what: str, value: float, micro: int | None = None) -> None:
        where = f"step {self.step + 1}" + (f", micro-batch {micro + 1}/{self.accum}" if micro is not None else "")
        last = f"the last good checkpoint is {self.last_saved}" if self.last_saved else "no checkpoint was written yet"
        fp32 = "" if self.precision == "fp32" else ", or use train.precision=fp32"
        raise TrainingError(
            f"{what} is {value} at {where}: stopped without saving ({last}). Lower train.lr or train.grad_clip, "
            f"lengthen train.warmup_steps{fp32}; resume with checkpoint.resume=auto"
        )

    def _set_window_dropout(self) -> float | None:
        t = self.recipe.train
        if not self.dropout_layers:
            return None
        p = window_dropout_at(self.step, self.total_steps, t.window_dropout, t.window_dropout_until,
                              time_fraction=self._time_fraction())
        set_window_dropout(self.dropout_layers, p, seed=t.seed, step=self.step, rank=self.rank)
        return p

    def _time_fraction(self) -> float:
        """The share of ``train.max_time`` spent so far (0 without a time limit)."""
        limit = self.recipe.train.max_time
        return min(1.0, self.train_seconds / limit) if limit else 0.0

    def _slowest(self, seconds: float) -> float:
        """The largest of the ranks' ``seconds``: every rank then keeps the same clock (LR, stop)."""
        if self.world == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())

    def _out_of_time(self) -> bool:
        """Whether ``train.max_time`` is spent (the same answer on every rank: one clock, see ``_slowest``)."""
        return bool(self.recipe.train.max_time) and self._time_fraction() >= 1.0

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        lr = self._set_lr()
        drop = self._set_window_dropout()
        losses, parts = [], {}
        for micro in range(self.accum):
            batch, answer_mask, positions = self._next_batch()
            try:
                with self.acc.accumulate(self.model):
                    documents = {} if positions is None else {"position_ids": positions}
                    loss, terms = self.objective(self.model, batch, answer_mask=answer_mask, **documents)
                    for k, v in terms.items():
                        parts[k] = parts.get(k, 0.0) + v / self.accum
                    mean = self._global_mean(loss)
                    if not math.isfinite(mean):
                        self._stop_non_finite("the training loss", mean, micro)
                    self.acc.backward(loss)
            except RetrofitError:
                raise
            except (RuntimeError, MemoryError) as exc:
                if is_out_of_memory(exc):
                    raise TrainingError(f"out of memory in a training step ({type(exc).__name__}): "
                                        f"{memory_advice(self.recipe.data.seq_len, self.recipe.train.micro_batch_size)}") from exc
                raise
            losses.append(mean)
        gnorm = self.engine.get_global_grad_norm()
        gnorm = None if gnorm is None else float(gnorm)
        if gnorm is not None and not math.isfinite(gnorm):
            self._stop_non_finite("the gradient norm", gnorm)
        self.step += 1
        step_tokens = self.recipe.train.batch_size * self.recipe.data.seq_len
        self.tokens += step_tokens
        dt = time.perf_counter() - t0
        self.train_seconds += self._slowest(dt) if self.recipe.train.max_time else dt
        out = {"loss": sum(losses) / len(losses), "lr": lr, "grad_norm": gnorm if gnorm is not None else float("nan"),
               "tokens": self.tokens, "tokens_per_s": step_tokens / dt, "step_time_s": dt}
        if len(parts) > 1 or (parts and "lm" not in parts):
            out.update({f"loss_{k}": v for k, v in parts.items()})
        if drop is not None:
            out["window_dropout"] = drop
        if self.cuda:  # peak since the start of training, this rank (activations, weights, optimizer shards)
            out["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    @torch.no_grad()
    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Mean next-token loss over the held-out sequences (every rank runs the same number of batches)."""
        if not self.eval_data:
            return None
        m = self.recipe.train.micro_batch_size
        mine = self.eval_data[self.rank::self.world]
        n_batches = math.ceil(math.ceil(len(self.eval_data) / self.world) / m)
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for b in range(n_batches):
            rows = mine[b * m:(b + 1) * m]
            weight = 1.0 if rows else 0.0  # ZeRO-3 needs every rank in every forward: pad with a dummy
            batch = torch.stack(rows or [self.eval_data[0]])
            positions = self._positions(batch)
            nll, targets = heldout_nll(self.model, batch.to(self.device), position_ids=positions,
                                       gather=self._gathered if self.zero_stage == 3 else None)
            total += torch.tensor([nll * weight, targets * weight], dtype=torch.float64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(total)
        self.model.train()
        loss = float(total[0] / total[1])
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "sequences": len(self.eval_data)}

    def _check_finite_weights(self) -> None:
        bad = torch.zeros(1, device=self.device)
        for name, p in self.model.module.named_parameters():
            if p.requires_grad:
                data = getattr(p, "ds_tensor", p)
                if data.numel() and not torch.isfinite(data).all():
                    bad += 1
        if self.world > 1:
            torch.distributed.all_reduce(bad)
        if bad.item():
            self._stop_non_finite("a trainable weight", float("nan"))

    def save(self) -> Path:
        self._check_finite_weights()
        final = ckpt.checkpoint_dir(self.output_dir, self.step)
        try:
            with (ckpt.publishing(final) if self.main else contextlib.nullcontext()) as tmp:
                tmp = self._from_main(tmp)
                try:
                    self.acc.wait_for_everyone()
                    self.acc.save_state(str(tmp), exclude_frozen_parameters=True)
                    _save_data_state(self.train_data.state_dict(), tmp, self.rank)
                    self.acc.wait_for_everyone()
                    if self.main:
                        if self.logger is not None:
                            self.logger.sync()  # every record up to this step is on disk before the checkpoint
                        ckpt.write_state(tmp, {
                            "step": self.step, "tokens": self.tokens, "train_seconds": self.train_seconds,
                            "world_size": self.world,
                            "total_steps": self.total_steps, "fingerprint": _fingerprint(self.recipe),
                            "base_fingerprint": self.base_fingerprint, "section_digest": self.section_digest,
                            "tokenizer_digest": self.tokenizer_digest, "data_digest": self.data_digest,
                            "time": time.time()})
                except OSError as exc:  # full or read-only disk: the temporary folder goes, no checkpoint appears
                    raise self._save_failed(final, exc) from None
                except Exception as exc:  # torch's zip writer and safetensors report a failed write (a full disk) so
                    if write_failure(exc) is None:
                        raise
                    raise self._save_failed(final, exc) from None
            if self.main:
                ckpt.rotate(self.output_dir, self.recipe.checkpoint.keep_last)
        except (OSError, CheckpointError) as exc:  # the publication itself (its rename, lock or swap), or rotation
            raise self._save_failed(final, exc) from None
        self.acc.wait_for_everyone()
        self.last_saved = final
        for cb in self.callbacks:
            cb.on_save(self.step, final)
        return final

    def _from_main(self, path: Path | None) -> Path:
        """Rank 0's ``path`` on every rank (the temporary folder only rank 0 can name)."""
        if self.world > 1:
            box = [None if path is None else str(path)]
            torch.distributed.broadcast_object_list(box, src=0)
            path = Path(box[0])
        return path

    def _save_failed(self, final: Path, exc: Exception) -> TrainingError:
        last = f"the last complete checkpoint is {self.last_saved or 'none'}"
        if isinstance(exc, CheckpointError):  # says what failed and what to do
            return TrainingError(f"{exc} ({last})")
        failed = write_failure(exc)
        reason = getattr(exc, "strerror", None) or (f"{failed} ({free_space(self.output_dir)})" if failed else exc)
        return TrainingError(f"cannot write checkpoint {final.name} into {self.output_dir}: {reason}; "
                             f"free space or choose a writable checkpoint.output_dir ({last})")

    def export(self) -> Path:
        """The trained model as a ``retrofit.load``-able folder at ``OUTPUT_DIR/final`` (LoRA merged in)."""
        from retrofit import surgery

        final = self.output_dir / "final"
        model = self.acc.unwrap_model(self.model)
        params = list(model.parameters())
        gather = self._gathered(params) if self.zero_stage == 3 else contextlib.nullcontext()
        with gather:
            if self.main:
                from retrofit.train.export import export_lora, training_card

                card = training_card(self.recipe, self.step, self.tokens, self.evals)
                if hasattr(model, "merge_and_unload"):  # LoRA: adapter/ + adapter-base/ beside final/, then merge
                    model = export_lora(model, self.output_dir, tokenizer=self.tokenizer, card=card)
                    card["adapter"] = str((self.output_dir / "adapter").resolve())
                model.config.use_cache = self.use_cache
                surgery.save(model, final, tokenizer=self.tokenizer, overwrite=True, card=card)
        self.acc.wait_for_everyone()
        return final

    @staticmethod
    def _gathered(params: list):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    # ------------------------------------------------------------------ the loop
    def _record(self, kind: str, metrics: dict) -> None:
        if self.logger is not None:
            self.logger.log(kind, self.step, metrics)

    def _eval_and_log(self) -> None:
        metrics = self.evaluate()
        if metrics is None:
            return
        self.evals.append({"step": self.step, **metrics})
        self._record("eval", metrics)
        self.log(f"[retrofit] step {self.step}: held-out loss {metrics['loss']:.4f} (ppl {metrics['ppl']:.2f})")
        for cb in self.callbacks:
            cb.on_eval(self.step, metrics)

    def run(self) -> TrainResult:
        from tqdm.auto import tqdm

        r = self.recipe
        self._train_iter = iter(self.train_data)
        for cb in self.callbacks:
            cb.on_train_begin(self.acc.unwrap_model(self.model))
        if self.resume_from is None:
            self._eval_and_log()
        elif self.step >= self.total_steps:
            self.log(f"[retrofit] {self.resume_from.name} already completes the run ({self.total_steps} steps); "
                     "raise train.max_steps to continue it")
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (self.main and r.logging.progress))
        try:
            while self.step < self.total_steps and not self._out_of_time():
                metrics = self.train_step()
                self.history.append({"step": self.step, **metrics})
                for cb in self.callbacks:
                    cb.on_step_end(self.step, metrics)
                bar.update(1)
                if self.step % r.logging.every == 0 or self.step == self.total_steps:
                    self._record("train", metrics)
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                    gnorm=f"{metrics['grad_norm']:.3g}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                    if bar.disable and self.main and not quiet():
                        print(f"[retrofit] step {self.step}/{self.total_steps} loss {metrics['loss']:.4f} "
                              f"lr {metrics['lr']:.3e} grad_norm {metrics['grad_norm']:.3g} "
                              f"tokens/s {metrics['tokens_per_s']:.0f}"
                              + (f" peak {metrics['peak_memory_gib']:.2f} GiB" if "peak_memory_gib" in metrics else ""),
                              flush=True)
                if r.eval.every and self.step % r.eval.every == 0 and self.step < self.total_steps:
                    self._eval_and_log()
                if self.step % r.checkpoint.save_every == 0 or self.step == self.total_steps:
                    self.save()
            if self.step < self.total_steps and self.history:  # stopped by train.max_time
                self.log(f"[retrofit] train.max_time ({r.train.max_time:g} s) spent after step {self.step} "
                         f"({self.tokens:,} tokens)")
                if self.step % r.checkpoint.save_every:
                    self.save()
            bar.close()
            # eval never drops; this leaves the layers as converted for callbacks that keep the model
            set_window_dropout(self.dropout_layers, 0.0)
            if self.history and (not self.evals or self.evals[-1]["step"] != self.step):
                self._eval_and_log()
            final = self.export() if r.checkpoint.export else None
            if final is not None:
                self.log(f"[retrofit] exported the trained model to {final}")
        finally:
            bar.close()
            if self.logger is not None:
                self.logger.close()
        return TrainResult(self.output_dir, final, self.step, self.tokens, self.counts, self.resume_from,
                           self.history, self.evals)


def _teardown() -> None:
    """Reset accelerate's singletons after a run in a world this process made, so a later run can start.

    The one-rank gloo process group itself stays up for the life of the process: DeepSpeed caches
    groups derived from it, and a later run reuses it.
    """
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def run_recipe(recipe: Recipe, *, callbacks: Sequence[TrainCallback] = ()) -> TrainResult:
    """Run (or resume) one recipe without stages. Launch-agnostic: plain process, ``torchrun`` or ``deepspeed``.

    :func:`retrofit.train.train` runs any recipe, staged ones stage by stage."""
    if recipe.stages:
        raise ValueError("run_recipe runs one recipe; a recipe with stages runs through retrofit.train.train")
    with single_process_env() as made_world:
        run = _Run(recipe, callbacks)
        try:
            run.setup()
            return run.run()
        finally:
            run.resources.close()
            if made_world:
                _teardown()
