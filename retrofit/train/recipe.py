"""Training recipes: a YAML file of sections, validated into dataclasses, with ``key=value`` overrides.

A recipe names the model (hub id, local path, alias or an already converted folder), the
conversion applied when the model is not converted yet, what trains, the data, the
optimisation, the DeepSpeed config, checkpoints and logging::

    model: {name: gemma3-270m}
    conversion: {method: macchiato, window: 128, latents: 128, init_swa_share: 0.5}
    trainable: {mode: new}
    data: {files: bundled:pg-books, holdout_last: 2, seq_len: 512}
    train: {max_steps: 300, batch_size: 4, lr: 6e-4, warmup_steps: 30}
    deepspeed: {config: deepspeed/zero2.json}
    checkpoint: {output_dir: runs/gemma3-270m-macchiato-cpu, save_every: 100}

Unknown keys raise :class:`~retrofit.errors.SpecError` naming the key and the valid ones.
Overrides use dotted paths (``train.lr=1e-4``); values are parsed as YAML and then coerced
to the field's type (so ``6e-4``, which YAML reads as a string, is a float here).

Paths: inputs (data files, the DeepSpeed JSON) resolve against the recipe file's folder, except
``bundled:NAME`` (data shipped in the package, e.g. ``bundled:pg-books``);
``${VAR}`` and ``${VAR:-default}`` expand from the environment first. Outputs
(``checkpoint.output_dir``) resolve against the current directory, like every CLI tool.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from retrofit.data.paths import expand_path
from retrofit.data.recall import RecallConfig
from retrofit.data.text import TEXT_ERRORS
from retrofit.errors import SpecError, parse_yaml

__all__ = [
    "Recipe", "ModelSection", "TrainableSection", "LoraSection", "DataSection", "RecallSection", "EvalSection",
    "TrainSection", "DeepSpeedSection", "CheckpointSection", "LoggingSection", "FitSection", "FitMapsSection",
    "FitScaleSection",
    "load_recipe", "recipe_from_dict", "apply_overrides", "expand_path", "bundled_recipe_dir",
    "stage_recipes", "stage_name", "recall_config",
]

TRAINABLE_MODES = ("new", "lora", "attention", "all")
# the most optimizer steps a run (or a stage, or a layer's fit) takes: 100 million, a hundred times the longest
# pretraining runs; more is a typo or "forever" (for a run bounded by the clock, set train.max_time instead)
MAX_STEPS = 100_000_000


@dataclass
class ModelSection:
    name: str = ""  # hub id, local path, alias (gemma3-270m, smollm2-135m) or an already converted folder
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16


@dataclass
class LoraSection:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list | None = None  # None: the model family's LoRA targets (retrofit.patches table)
    # any other peft.LoraConfig field written in this section (use_dora, modules_to_save, rank_pattern,
    # init_lora_weights, ...) is collected here and passed through; PEFT's field list checks it
    peft: dict = field(default_factory=dict)
    PASSTHROUGH: ClassVar[str] = "peft"


@dataclass
class TrainableSection:
    mode: str = "new"  # new | lora | attention | all
    lora: LoraSection = field(default_factory=LoraSection)
    extra: list = field(default_factory=list)  # regexes of further parameter names to train


@dataclass
class RecallSection:
    share: float = RecallConfig.share  # share of training sequences given long-range recall facts (0 = off)
    facts: int = RecallConfig.facts  # facts per rewritten sequence, each asked about later
    min_distance: int = RecallConfig.min_distance  # tokens from a fact to its answer (at least)
    seed: int = RecallConfig.seed  # the rewrite of sequence i is a function of (seed, i) only
    answer_weight: float = RecallConfig.answer_weight  # attention term: weight of the answer positions (others 1)
    style: str = RecallConfig.style  # facts (worded templates) | repeats (cue of the text's own tokens + value) | mixed


@dataclass
class DataSection:
    dataset: str = "cerebras/SlimPajama-627B"  # hub dataset, streamed; used when `files` is empty
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    files: Any = None  # local txt/jsonl/parquet: a file, folder, glob or list (relative to the recipe)
    holdout_last: int = 0  # keep the last N local files (sorted by name) out of training, for eval
    strip_gutenberg: bool = False  # drop Project Gutenberg headers / licence text around each document
    bos_every_sequence: bool = True  # start every packed sequence with BOS (if the tokenizer uses one)
    document_boundaries: bool = True  # each packed document is read alone: positions restart, no state crosses
    seq_len: int = 4096
    shuffle_buffer: int = 1000  # packed sequences held for shuffling (0 = off)
    seed: int = 0
    allow_long_positions: bool = False  # allow seq_len > the model's max_position_embeddings
    text_errors: str = "strict"  # strict: non-UTF-8 text is an error (file + byte offset) | replace: U+FFFD
    recall: RecallSection = field(default_factory=RecallSection)  # training sequences only, never eval


@dataclass
class EvalSection:
    every: int = 0  # held-out loss every N optimizer steps (0: only before and after training)
    sequences: int = 16  # packed sequences of data.seq_len (spread over local files; the first N of a stream)
    files: Any = None  # local eval files; default: the held-out files, else the hub `split` below
    split: str = "validation"


@dataclass
class TrainSection:
    max_steps: int | None = 1000  # at most MAX_STEPS (100M); the steps max_tokens alone makes too
    max_tokens: int | None = None  # token budget: stop at whichever of max_steps / max_tokens comes first
    max_time: float | None = None  # seconds of training (all resumes together); also stops the run, LR follows the clock
    batch_size: int = 4  # global sequences per optimizer step (all ranks, all accumulation steps)
    micro_batch_size: int = 1  # sequences per forward pass per rank
    lr: float = 6e-4
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    warmup_steps: int = 2000
    schedule: str = "cosine"  # cosine | constant (both after linear warmup)
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    objective: str = "lm"  # lm | attention | weights | kl | recall | mix (see retrofit.train.objectives)
    objective_weights: dict = field(default_factory=dict)  # mix only: {lm: w, attention: w, kl: w}
    head_positions: int | None = None  # kl / lm terms: the LM head runs on this many sampled positions per sequence
    layer_weights: dict = field(default_factory=dict)  # attention / weights terms: {"13-29": 4.0} weighs those layers' losses (others 1)
    weights_queries: int | None = None  # weights term: query rows per sequence compared (None: retrofit.layers.base's default, 64)
    window_dropout: float = 0.0  # Macchiato: P(a layer's window branch is dropped for a sequence) at step 0 ...
    window_dropout_until: float = 1.0  # ... decaying linearly to 0 at this fraction of the steps (train/window_dropout.py)
    gradient_checkpointing: bool = True
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    seed: int = 0


@dataclass
class DeepSpeedSection:
    config: str = "deepspeed/zero2.json"  # relative to the recipe file, or a bundled name
    zero_stage: int | None = None  # override the JSON's stage (0-3)
    offload_optimizer: bool = False  # optimizer states + step on the CPU (DeepSpeedCPUAdam)
    offload_params: bool = False  # ZeRO-3 only: parameters on the CPU


@dataclass
class CheckpointSection:
    output_dir: str = "runs/retrofit"
    save_every: int = 1000
    keep_last: int = 3
    resume: str = "auto"  # auto (newest complete checkpoint, if any) | none | a checkpoint folder
    export: bool = True  # write a retrofit.load-able folder to OUTPUT_DIR/final at the end


@dataclass
class LoggingSection:
    every: int = 10
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "retrofit"
    run_name: str | None = None
    progress: bool = True


@dataclass
class FitMapsSection:
    seq_len: int = 4096  # tokens per sequence the maps are fitted on
    sequences: int = 8  # sequences whose layer inputs are captured (0: keep the maps as they are)
    steps: int = 150  # Adam steps per layer, each on `queries` random rows of one of the sequences
    queries: int = 128  # query rows per step
    lr: float = 1e-2
    recall_facts: int | None = None  # data.recall.facts in these sequences (None: data.recall.facts)


@dataclass
class FitScaleSection:
    seq_len: int = 16384  # may pass the base's context: the teacher is then the base with its RoPE distances capped
    sequences: int = 3  # sequences in the least squares (0: keep the scale as it is)
    queries: int = 256  # random query rows per sequence
    recall_facts: int | None = None  # data.recall.facts in these sequences (None: data.recall.facts)


@dataclass
class FitSection:  # read by `retrofit fit` (retrofit.train.fit), not by `retrofit train`
    maps: FitMapsSection = field(default_factory=FitMapsSection)
    scale: FitScaleSection = field(default_factory=FitScaleSection)


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    conversion: dict = field(default_factory=dict)  # ConversionSpec fields, applied if not converted yet
    trainable: TrainableSection = field(default_factory=TrainableSection)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    stages: list = field(default_factory=list)  # partial recipes run in order (retrofit.train.stages)
    fit: FitSection = field(default_factory=FitSection)  # `retrofit fit`: the read fitted layer by layer
    base_dir: str = field(default=".", metadata={"internal": True})  # folder inputs resolve against

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("base_dir")
        return out

    def resolve_input(self, value: str) -> Path:
        """An input path from this recipe: env-expanded, relative to the recipe's folder."""
        return expand_path(value, self.base_dir)

    def validate(self) -> "Recipe":
        """Cross-field checks that need no model or device."""
        t, d = self.train, self.data
        if not self.model.name:
            raise SpecError("model.name is empty: give a hub id, a local folder, an alias (gemma3-270m, smollm2-135m) "
                            "or a converted checkpoint folder")
        if self.trainable.mode not in TRAINABLE_MODES:
            raise SpecError(f"trainable.mode must be one of {', '.join(TRAINABLE_MODES)}, got {self.trainable.mode!r}")
        if t.max_steps is None and t.max_tokens is None and not self.stages:  # stages: checked per stage
            raise SpecError("set train.max_steps or train.max_tokens (or both: training stops at the first reached)")
        for name, value in (("train.max_steps", t.max_steps), ("train.max_tokens", t.max_tokens)):
            if value is not None and value < 1:
                raise SpecError(f"{name} must be >= 1, got {value}")
        self._check_step_bound()
        if t.max_time is not None and not (isinstance(t.max_time, (int, float)) and not isinstance(t.max_time, bool)
                                           and math.isfinite(t.max_time)
                                           and t.max_time > 0):
            raise SpecError(f"train.max_time must be a number of seconds > 0 (or null for no time limit), got {t.max_time!r}")
        if not 0 <= t.seed < 2**32:  # set_seed seeds numpy too, which takes no other seed
            raise SpecError(f"train.seed must be a whole number from 0 to 2**32 - 1, got {t.seed}")
        for name, value in (("data.seq_len", d.seq_len), ("train.batch_size", t.batch_size),
                            ("train.micro_batch_size", t.micro_batch_size), ("checkpoint.save_every", self.checkpoint.save_every),
                            ("logging.every", self.logging.every)):
            if value < 1:
                raise SpecError(f"{name} must be >= 1, got {value}")
        if d.seq_len < 2:
            raise SpecError(f"data.seq_len must be >= 2 (next-token targets), got {d.seq_len}")
        if t.batch_size % t.micro_batch_size:
            raise SpecError(f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size ({t.micro_batch_size})")
        if t.schedule not in ("cosine", "constant"):
            raise SpecError(f"train.schedule must be 'cosine' or 'constant', got {t.schedule!r}")
        if t.precision not in ("auto", "bf16", "fp32"):
            raise SpecError(f"train.precision must be auto, bf16 or fp32, got {t.precision!r}")
        if self.model.dtype not in ("auto", "float32", "bfloat16"):
            raise SpecError(f"model.dtype must be auto, float32 or bfloat16, got {self.model.dtype!r}")
        for name, value, low, strict in (("train.lr", t.lr, 0.0, True), ("train.eps", t.eps, 0.0, True),
                                         ("train.grad_clip", t.grad_clip, 0.0, False),
                                         ("train.weight_decay", t.weight_decay, 0.0, False)):
            if not math.isfinite(value) or value < low or (strict and value == low):
                bound = "> 0" if strict else ">= 0 (0 = off)" if name == "train.grad_clip" else ">= 0"
                raise SpecError(f"{name} must be a finite number {bound}, got {value}")
        if d.text_errors not in TEXT_ERRORS:
            raise SpecError(f"data.text_errors must be one of {', '.join(TEXT_ERRORS)}, got {d.text_errors!r}")
        recall_config(self)  # SpecError naming data.recall.<key>
        if not 0.0 <= t.min_lr_ratio <= 1.0:
            raise SpecError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        try:
            betas = [float(b) for b in t.betas]
        except (TypeError, ValueError):
            betas = []
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise SpecError(f"train.betas must be two numbers in [0, 1), got {t.betas}")
        t.betas = betas
        if t.warmup_steps < 0 or d.holdout_last < 0 or d.shuffle_buffer < 0 or self.eval.every < 0 or self.eval.sequences < 0:
            raise SpecError("train.warmup_steps, data.holdout_last, data.shuffle_buffer, eval.every and eval.sequences must be >= 0")
        if self.checkpoint.keep_last < 1:
            raise SpecError(f"checkpoint.keep_last must be >= 1, got {self.checkpoint.keep_last}")
        from retrofit.train.objectives import objective_weights

        terms = objective_weights(t.objective, t.objective_weights)  # SpecError naming the bad key
        teacher_terms = sorted(set(terms) & {"attention", "weights", "kl"})
        if teacher_terms and self.trainable.mode in ("attention", "all"):
            raise SpecError(f"train.objective {t.objective!r} distils toward the model's own frozen pretrained weights "
                            f"({', '.join(teacher_terms)}), which trainable.mode {self.trainable.mode!r} would train, "
                            "moving the teacher with the student: use trainable.mode new or lora "
                            "(adapters are bypassed for the teacher), or objective lm")
        if t.layer_weights:
            from retrofit.train.objectives import layer_weights

            layer_weights(t.layer_weights)  # SpecError naming the bad key
            if not {"attention", "weights"} & set(terms):
                raise SpecError(f"train.layer_weights weighs the attention (or weights) term's per-layer losses, but "
                                f"train.objective {t.objective!r} has neither: drop layer_weights or use objective "
                                "attention / weights / mix")
        if "weights" in terms:
            q = t.weights_queries
            if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
                raise SpecError(f"train.weights_queries must be a positive integer or null (the default), got {q!r}")
            self._check_attention_weights()
        if d.recall.answer_weight != 1.0 and "attention" not in terms:
            raise SpecError(f"data.recall.answer_weight weighs the answers' positions in the attention term, but "
                            f"train.objective {t.objective!r} has none: set it to 1 here (a stage may override it) "
                            "or use objective attention / mix")
        if "recall" in terms and not d.recall.share:
            raise SpecError("train.objective's recall term trains on recall answers, but data.recall.share is 0 (no "
                            "sequence has any): set data.recall.share > 0 (and facts, min_distance)")
        if d.recall.answer_weight != 1.0 and not d.recall.share:
            raise SpecError("data.recall.answer_weight weighs recall answers, but data.recall.share is 0 (no sequence "
                            "has any): set data.recall.share > 0 or drop answer_weight")
        if t.head_positions is not None and (not isinstance(t.head_positions, int) or t.head_positions < 1):
            raise SpecError(f"train.head_positions must be a positive integer or null (all positions), got {t.head_positions!r}")
        if not (math.isfinite(t.window_dropout) and 0.0 <= t.window_dropout <= 1.0):
            raise SpecError(f"train.window_dropout must be in [0, 1] (0 = off), got {t.window_dropout}")
        if not (math.isfinite(t.window_dropout_until) and 0.0 < t.window_dropout_until <= 1.0):
            raise SpecError(f"train.window_dropout_until must be in (0, 1] (the fraction of the steps over which "
                            f"the drop probability decays to 0), got {t.window_dropout_until}")
        if t.window_dropout > 0:
            self._check_window_dropout()
        if self.stages:
            stage_recipes(self)  # every stage validated now, before any weight is loaded
        if self.deepspeed.zero_stage is not None and self.deepspeed.zero_stage not in (0, 1, 2, 3):
            raise SpecError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.deepspeed.zero_stage}")
        if d.files is None and d.holdout_last:
            raise SpecError("data.holdout_last needs local data.files (a streamed hub dataset has no file order)")
        self._check_output_outside_data()
        self._check_output_outside_model()
        self._check_fit()
        return self

    def _check_step_bound(self) -> None:
        """``train.max_steps`` (or the steps ``train.max_tokens`` makes, where it alone bounds the run) at most
        :data:`MAX_STEPS`: a run that would never end is refused before anything loads."""
        t, d = self.train, self.data
        why = ("a hundred times the longest pretraining runs; to stop a run by the clock, set train.max_time "
               "(seconds) beside a max_steps within the bound")
        if t.max_steps is not None and t.max_steps > MAX_STEPS:
            raise SpecError(f"train.max_steps={t.max_steps} is more optimizer steps than any run takes: give at most "
                            f"{MAX_STEPS:,} ({why})")
        per_step = t.batch_size * d.seq_len
        if t.max_steps is None and t.max_tokens is not None and per_step >= 1 and -(-t.max_tokens // per_step) > MAX_STEPS:
            raise SpecError(f"train.max_tokens={t.max_tokens} is {-(-t.max_tokens // per_step):,} optimizer steps of "
                            f"{t.batch_size} x {d.seq_len} tokens, more than any run takes: give at most "
                            f"{MAX_STEPS * per_step:,} tokens ({MAX_STEPS:,} steps: {why})")

    def _check_fit(self) -> None:
        """``fit.maps`` / ``fit.scale``: counts and lengths a fit can use."""
        for name, part in (("fit.maps", self.fit.maps), ("fit.scale", self.fit.scale)):
            if part.seq_len < 2 or part.sequences < 0 or part.queries < 1:
                raise SpecError(f"{name}: seq_len must be >= 2, sequences >= 0 and queries >= 1 "
                                f"(got {part.seq_len}, {part.sequences}, {part.queries})")
            if part.recall_facts is not None and part.recall_facts < 1:
                raise SpecError(f"{name}.recall_facts must be >= 1 or null (data.recall.facts), got {part.recall_facts}")
        m = self.fit.maps
        if m.steps < 0 or not (math.isfinite(m.lr) and m.lr > 0):
            raise SpecError(f"fit.maps: steps must be >= 0 and lr a finite number > 0 (got {m.steps}, {m.lr})")
        if m.steps > MAX_STEPS:
            raise SpecError(f"fit.maps.steps={m.steps} is more Adam steps per layer than any fit takes: give at most "
                            f"{MAX_STEPS:,} (the default is 150)")
        if m.steps and not m.sequences:
            raise SpecError("fit.maps.steps > 0 needs fit.maps.sequences > 0 to fit on (or set steps: 0 to keep the maps)")

    def _check_attention_weights(self) -> None:
        """The conversion's method has attention weights to distil (an empty conversion: the model is
        converted already, checked when the objective first runs)."""
        from retrofit.layers.method import registered_method

        conversion = self.conversion if isinstance(self.conversion, dict) else {}
        method = conversion.get("method")
        if not conversion:
            return
        info = registered_method(method or "macchiato")
        if info is None or "attention_weights" not in info.config.capabilities:
            raise SpecError(f"train.objective's weights term distils a layer's attention weights, which conversion.method "
                            f"{method!r} does not expose as one distribution (method hedgehog does): use objective "
                            "attention or kl")

    def _check_window_dropout(self) -> None:
        """The conversion's method declares the ``window_dropout`` capability and its config allows it
        (an empty conversion: the model is converted already, checked when it is loaded)."""
        from retrofit.layers.method import registered_method
        from retrofit.surgery.spec import ConversionSpec
        from retrofit.train.window_dropout import WINDOW_DROPOUT

        conversion = self.conversion if isinstance(self.conversion, dict) else {}
        method = conversion.get("method")
        info = registered_method(method or ConversionSpec.DEFAULT_METHOD)
        if info is None or WINDOW_DROPOUT not in info.config.capabilities:
            raise SpecError(f"train.window_dropout drops a converted layer's sliding-window branch; conversion.method "
                            f"is {method!r}, which has none (set train.window_dropout=0)")
        ConversionSpec.from_dict(conversion).config.check_capability(WINDOW_DROPOUT)

    def _check_output_outside_model(self) -> None:
        """``checkpoint.output_dir`` is not the input model's folder nor inside it: the run writes recipe.yaml,
        metrics and checkpoints there, replacing the model's own files (its recipe.yaml) and mixing with them."""
        model = Path(str(self.model.name)).expanduser()  # as the trainer loads it
        if not model.is_dir():
            return  # a hub id or alias
        out, folder = Path(self.checkpoint.output_dir).expanduser().resolve(), model.resolve()
        if out == folder or folder in out.parents:
            where = "is" if out == folder else "lies inside"
            raise SpecError(f"checkpoint.output_dir {self.checkpoint.output_dir} {where} the input model folder "
                            f"{self.model.name}: the run would write over the model's files; set "
                            "checkpoint.output_dir to a folder outside the model")

    def _check_output_outside_data(self) -> None:
        """``checkpoint.output_dir`` is not a data folder nor inside one: the next run would read the
        run's own metrics.jsonl (and any other file written there) as training or held-out text."""
        out = Path(self.checkpoint.output_dir).expanduser().resolve()  # as the trainer resolves it
        for key, spec in (("data.files", self.data.files), ("eval.files", self.eval.files)):
            for item in spec if isinstance(spec, (list, tuple)) else [] if spec is None else [spec]:
                if item is None or not str(item).strip():
                    continue  # an empty path: reported where the data files are resolved
                try:
                    p = expand_path(str(item), self.base_dir)
                except SpecError:
                    continue  # reported where the data files are resolved
                if any(ch in str(p) for ch in "*?["):  # a glob: the folder above its first wildcard
                    parts = p.parts
                    p = Path(*parts[:next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))])
                elif not p.is_dir():
                    continue
                folder = p.resolve()
                if out == folder or folder in out.parents:
                    where = "is" if out == folder else "lies inside"
                    raise SpecError(f"checkpoint.output_dir {self.checkpoint.output_dir} {where} the {key} folder "
                                    f"{folder}: the next run would train on this run's own files (metrics.jsonl); "
                                    "set checkpoint.output_dir to a folder outside the data")


def recall_config(recipe: Recipe) -> RecallConfig:
    """``data.recall`` as a checked :class:`~retrofit.data.recall.RecallConfig`."""
    return RecallConfig(**dataclasses.asdict(recipe.data.recall)).check("data.recall")


# ----------------------------------------------------------------------------- stages
# A recipe with ``stages:`` expands into one recipe per stage (running them: retrofit.train.stages).
_FORBIDDEN = {("model",): "a stage starts from the previous stage's model; set model.name at the top level",
              ("stages",): "stages do not nest",
              ("checkpoint", "output_dir"): "each stage writes into OUTPUT_DIR/stage-<i>-<name>; set "
                                            "checkpoint.output_dir at the top level"}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def stage_name(i: int, stage: dict) -> str:
    """Stage ``i``'s (1-based) name: its ``name`` key, else ``stage<i>``; checked for use in a folder name."""
    name = str(stage.get("name") or f"stage{i}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SpecError(f"stages[{i - 1}].name {name!r}: use letters, digits, '_', '-' or '.'")
    return name


def _check_stage(i: int, stage: Any) -> dict:
    if not isinstance(stage, dict):
        raise SpecError(f"stages[{i - 1}] must be a mapping (a partial recipe), got {stage!r}")
    for path, why in _FORBIDDEN.items():
        node = stage
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            raise SpecError(f"stages[{i - 1}] sets {'.'.join(path)}: {why}")
    if i > 1 and stage.get("conversion"):
        raise SpecError(f"stages[{i - 1}] sets conversion: only the first stage converts the model "
                        "(later stages continue the converted model)")
    return {k: v for k, v in stage.items() if k != "name"}


def stage_recipes(recipe: Recipe) -> list[tuple[str, Recipe]]:
    """``[(folder name, recipe)]`` of every stage, validated before any weight is loaded.

    Stage ``i > 1``'s ``model.name`` points at stage ``i - 1``'s ``final/`` folder.
    """
    if not isinstance(recipe.stages, list) or not recipe.stages:
        raise SpecError("stages must be a non-empty list of partial recipes")
    base = recipe.to_dict()
    base.pop("stages")
    out_dir = Path(recipe.checkpoint.output_dir).expanduser().resolve()
    result: list[tuple[str, Recipe]] = []
    names = set()
    prev_final: Path | None = None
    for i, raw in enumerate(recipe.stages, start=1):
        stage = _check_stage(i, raw)
        name = stage_name(i, raw)
        if name in names:
            raise SpecError(f"stages: two stages are named {name!r}")
        names.add(name)
        folder = f"stage-{i}-{name}"
        data = _merge(base, stage)
        data["checkpoint"]["output_dir"] = str(out_dir / folder)
        if prev_final is not None:
            data["model"]["name"] = str(prev_final)
            data["conversion"] = {}
        if i < len(recipe.stages):
            data["checkpoint"]["export"] = True  # the next stage starts from it
        try:
            sub = recipe_from_dict(data, base_dir=recipe.base_dir)
        except SpecError as exc:
            raise SpecError(f"stages[{i - 1}] ({name}): {exc}") from None
        result.append((folder, sub))
        prev_final = out_dir / folder / "final"
    return result


# ----------------------------------------------------------------------------- building
def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _public_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """YAML value -> the field's type, or SpecError naming the key."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise SpecError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise SpecError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
        raise SpecError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise SpecError(f"{key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise SpecError(f"{key} must be a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise SpecError(f"{key} must be a string, got {value!r}")
        if isinstance(value, bool):  # checkpoint.resume=no became 'False', a checkpoint folder of that name
            raise SpecError(f"{key} must be a string, got {str(value).lower()} (YAML reads an unquoted yes / no / "
                            "on / off / true / false as true or false): quote the word, or give another value")
        return str(value)
    if tp is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, str):
            return [s.strip() for s in value.split(",") if s.strip()]
        raise SpecError(f"{key} must be a list, got {value!r}")
    if tp is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise SpecError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{prefix.rstrip('.') or 'the recipe'} must be a mapping of keys, got {data!r}")
    fields = _public_fields(cls)
    unknown = [k for k in data if k not in fields]
    passthrough = getattr(cls, "PASSTHROUGH", None)
    if passthrough and unknown:  # e.g. trainable.lora.use_dora -> trainable.lora.peft.use_dora
        data = {**{k: v for k, v in data.items() if k not in unknown},
                passthrough: {**dict(data.get(passthrough) or {}), **{k: data[k] for k in unknown}}}
        unknown = []
    if unknown:
        where = f"in section '{prefix.rstrip('.')}'" if prefix else "at the top level"
        raise SpecError(f"unknown recipe key '{prefix}{unknown[0]}' {where}; valid keys: {', '.join(fields)}")
    kwargs = {}
    for name, tp in fields.items():
        if name not in data:
            continue
        kwargs[name] = _build(tp, data[name], f"{prefix}{name}.") if _is_section(tp) else _coerce(data[name], tp, prefix + name)
    return cls(**kwargs)


def recipe_from_dict(data: dict, base_dir: str | os.PathLike = ".") -> Recipe:
    """Validate a plain dict (as read from YAML) into a :class:`Recipe`."""
    recipe = _build(Recipe, data, "")
    recipe.base_dir = str(Path(base_dir).resolve())
    return recipe.validate()


def _parse_override(item: str) -> tuple[list[str], Any]:
    import yaml

    if "=" not in item:
        raise SpecError(f"override {item!r} must look like section.key=value (for example train.lr=1e-4)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise SpecError(f"override key {key!r} must be a dotted path like train.lr")
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        if hasattr(exc, "duplicate_key"):  # a mapping, not a string: taken as the text it would only be refused later
            from retrofit.errors import yaml_error_line

            raise SpecError(f"override {item!r}: {yaml_error_line(exc)}") from None
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set ``a.b.c=value`` items into a nested dict (in place; returns it). Keys are checked later."""
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError(f"override {item!r}: '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def bundled_recipe_dir() -> Path:
    """The recipes shipped with the package (``configs/``, imported as ``retrofit.configs``)."""
    import retrofit.configs

    return Path(retrofit.configs.__file__).resolve().parent


def _find_recipe(path: str | os.PathLike) -> Path:
    """A recipe file: the path itself, else a bundled recipe when ``path`` names one (``NAME``,
    ``NAME.yaml`` or ``configs/NAME.yaml``, the folder they live in within the repository). Any other
    missing path is an error, never a bundled recipe that shares its file name."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    from retrofit.fs.guard import special_kind

    if special_kind(p):  # /dev/null, a pipe: there, but no recipe
        raise SpecError(f"recipe file {str(path)!r} is {special_kind(p)}; give a YAML recipe file or the name of a "
                        "bundled recipe (retrofit ls)")
    names_bundled = not p.is_absolute() and p.parent in (Path("."), Path("configs"))
    candidates = (bundled_recipe_dir() / p.name, bundled_recipe_dir() / f"{p.name}.yaml")
    found = next((c for c in candidates if c.is_file()), None)
    if names_bundled and found is not None:
        return found
    from retrofit.catalog import recipe_names

    if found is not None:
        raise SpecError(f"recipe file {str(path)!r} not found (the bundled recipe of that name is "
                        f"'retrofit train {found.stem}')")
    raise SpecError(f"recipe file {str(path)!r} not found; bundled recipes: {', '.join(recipe_names())} "
                    "(retrofit ls lists them with the convert specs, datasets and DeepSpeed configs)")


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (a path, or the name of a bundled one), apply overrides, validate."""
    import yaml

    file = _find_recipe(path)
    try:
        data = parse_yaml(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        from retrofit.errors import yaml_error_line

        raise SpecError(f"recipe {file} is not valid YAML: {yaml_error_line(exc)}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"recipe {file} is not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
                        "save it as UTF-8") from None
    if not isinstance(data, dict):
        raise SpecError(f"recipe {file} must be a mapping of sections (model, data, train, ...)")
    apply_overrides(data, list(overrides or []))
    return recipe_from_dict(data, base_dir=file.parent)
