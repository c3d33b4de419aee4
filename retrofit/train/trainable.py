"""Which parameters train: the recipe's ``trainable`` section applied to a (converted) model.

Modes:

* ``new`` - only the weights the conversion added (``retrofit.surgery.new_parameter_names``);
* ``lora`` - PEFT LoRA adapters on the named projections, plus the new weights (as PEFT
  ``modules_to_save``); any other ``peft.LoraConfig`` field in ``trainable.lora`` passes through;
* ``attention`` - every parameter inside an attention module (pretrained q/k/v/o and the new weights);
* ``all`` - everything.

``trainable.extra`` adds parameters whose names match any of its regexes. Everything else
gets ``requires_grad=False``; the optimizer is then built from the trainable parameters only,
so it holds no state for frozen weights.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Collection

from torch import nn

from retrofit.errors import SpecError

__all__ = ["apply_trainable", "ParameterCounts", "count_parameters", "ATTENTION_PATTERN"]

# attention modules in transformers decoder layers (and their retrofit replacements, which keep the name)
ATTENTION_PATTERN = re.compile(r"(^|\.)(self_attn|attention|attn)\.")


@dataclass(frozen=True)
class ParameterCounts:
    trainable: int
    total: int

    def __str__(self) -> str:
        pct = 100.0 * self.trainable / max(self.total, 1)
        return f"trainable parameters: {self.trainable:,} / {self.total:,} ({pct:.4g}%)"


def count_parameters(model: nn.Module) -> ParameterCounts:
    """Trainable / total element counts (each shared tensor counted once)."""
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # ZeRO-3 partitions report their full size
        total += n
        trainable += n if p.requires_grad else 0
    return ParameterCounts(trainable, total)


def apply_trainable(
    model: nn.Module,
    mode: str,
    new_parameter_names: Collection[str],
    *,
    lora: dict | None = None,
    extra: Collection[str] = (),
) -> nn.Module:
    """Freeze everything, then unfreeze what ``mode`` selects. Returns the model (a PEFT wrapper for ``lora``)."""
    params = dict(model.named_parameters())
    missing = [n for n in new_parameter_names if n not in params]
    if missing:
        raise SpecError(f"new parameter {missing[0]!r} is not a parameter of the model")
    patterns = []
    for rx in extra:
        try:
            patterns.append(re.compile(rx))
        except re.error as exc:
            raise SpecError(f"trainable.extra pattern {rx!r} is not a valid regex: {exc}") from None

    model.requires_grad_(False)
    selected = set(new_parameter_names)
    if mode == "all":
        selected = set(params)
    elif mode == "attention":
        selected |= {n for n in params if ATTENTION_PATTERN.search(n)}
    elif mode not in ("new", "lora"):
        raise SpecError(f"trainable.mode must be one of new, lora, attention, all; got {mode!r}")
    selected |= {n for n in params if any(p.search(n) for p in patterns)}
    if mode == "lora":  # the new weights train as PEFT modules_to_save (copies PEFT owns and exports)
        selected = {n for n in params if any(p.search(n) for p in patterns)}
    chosen = [params[n] for n in selected]

    if mode == "lora":
        model = _wrap_lora(model, lora or {})
    for p in chosen:
        p.requires_grad_(True)
    if not any(p.requires_grad for p in model.parameters()):
        raise SpecError(f"trainable.mode={mode!r} selects no parameters (the conversion added no new weights?): "
                        "use trainable.mode=lora, attention or all, or name some with trainable.extra")
    return model


def _wrap_lora(model: nn.Module, cfg: dict) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = cfg.get("target_modules")
    if targets is None:  # the family's own projections (a fused qkv_proj for Phi-3)
        from retrofit.patches import get_patch

        targets = get_patch(model).lora_targets
    targets = list(targets)
    if not targets:
        raise SpecError("trainable.lora.target_modules is empty: name the projections to adapt (e.g. q_proj, v_proj)")
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    absent = [t for t in targets if t not in names]
    if absent:
        raise SpecError(f"trainable.lora.target_modules: no module named {absent[0]!r} in the model "
                        f"(linear layers it has: {', '.join(sorted(_linear_names(model)))})")
    extra = dict(cfg.get("peft") or {})
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    unknown = sorted(set(extra) - fields)
    if unknown:
        raise SpecError(f"trainable.lora.{unknown[0]} is not a peft.LoraConfig field "
                        f"(fields: {', '.join(sorted(f for f in fields if not f.startswith('_')))})")
    for key in ("r", "lora_alpha", "lora_dropout", "target_modules"):
        if key in extra:
            raise SpecError(f"trainable.lora.{key}: write it as trainable.lora."
                            f"{ {'lora_alpha': 'alpha', 'lora_dropout': 'dropout'}.get(key, key) }")
    from retrofit.surgery import new_module_names

    # the conversion's new weights: full copies PEFT trains and saves in the adapter
    extra["modules_to_save"] = sorted(set(extra.get("modules_to_save") or []) | set(new_module_names(model)))
    extra.setdefault("bias", "none")
    extra.setdefault("task_type", "CAUSAL_LM")  # AutoPeftModelForCausalLM reloads it through AutoModelForCausalLM
    try:
        config = LoraConfig(r=int(cfg.get("r", 16)), lora_alpha=int(cfg.get("alpha", 32)),
                            lora_dropout=float(cfg.get("dropout", 0.0)), target_modules=targets, **extra)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"trainable.lora: peft.LoraConfig refused it: {exc}") from None
    return get_peft_model(model, config)


def _linear_names(model: nn.Module) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
