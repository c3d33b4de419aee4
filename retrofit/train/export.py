"""What a finished run writes besides checkpoints: the model card facts and, for LoRA runs, a PEFT adapter.

``trainable.mode: lora`` trains LoRA matrices on the named projections plus the conversion's new
weights, which PEFT holds as ``modules_to_save``. :func:`export_lora` writes, next to
``OUTPUT_DIR/final`` (the merged model ``retrofit.load`` reads):

* ``OUTPUT_DIR/adapter/``: ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's own
  format; the new weights are in ``modules_to_save``), its ``base_model_name_or_path`` pointing at
* ``OUTPUT_DIR/adapter-base/``: the converted model the adapter was trained on (pretrained
  weights, new weights at their initial values), a ``retrofit.load`` / ``AutoModelForCausalLM``
  folder. ``peft.AutoPeftModelForCausalLM.from_pretrained(OUTPUT_DIR/adapter)`` then gives the
  same logits as ``OUTPUT_DIR/final``; the adapter's README.md names ``adapter-base`` as its
  ``base_model`` too (not the unconverted base, which would load the adapter without the new weights).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["adapter_base_state_dict", "export_lora", "training_card"]


def training_card(recipe: Any, step: int, tokens: int, evals: list[dict]) -> dict:
    """``card=`` facts for ``surgery.save``: data, steps, tokens, and the held-out loss when measured."""
    data = recipe.data
    source = data.files if data.files else f"{data.dataset} ({data.split})"
    training = {
        "recipe base model": f"`{recipe.model.name}`",
        "data": f"`{source}`, packed to {data.seq_len} tokens",
        "optimizer steps": step,
        "training tokens": f"{tokens:,}",
        "trainable": recipe.trainable.mode,
        "learning rate": recipe.train.lr,
    }
    metrics = {}
    if evals:
        first, last = evals[0], evals[-1]
        metrics[f"held-out loss (nats/token), step {first['step']}"] = float(first["loss"])
        if last is not first:
            metrics[f"held-out loss (nats/token), step {last['step']}"] = float(last["loss"])
        if "ppl" in last:
            metrics[f"held-out perplexity, step {last['step']}"] = float(last["ppl"])
    return {"training": training, "metrics": metrics or None}


def adapter_base_state_dict(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's weights without the adapter: LoRA removed, ``modules_to_save`` at their originals."""
    out = {}
    for key, value in peft_model.get_base_model().state_dict().items():
        if ".lora_" in key or ".modules_to_save." in key or "lora_magnitude_vector" in key:
            continue
        plain = key.replace(".base_layer.", ".").replace(".original_module.", ".")
        # adapted / wrapped tensors are copied (merging writes into base_layer in place); the rest is shared
        out[plain] = value.detach().clone() if plain != key else value
    return out


def export_lora(peft_model: nn.Module, output_dir: str | Path, *, tokenizer: Any = None, card: dict | None = None) -> nn.Module:
    """Write ``adapter/`` and ``adapter-base/`` (see the module docstring); return the merged model."""
    from retrofit.surgery import save
    from retrofit.surgery.checkpoint import atomic_directory

    output_dir = Path(output_dir)
    adapter_dir, base_dir = output_dir / "adapter", output_dir / "adapter-base"
    base_sd = adapter_base_state_dict(peft_model)
    for cfg in peft_model.peft_config.values():
        cfg.base_model_name_or_path = str(base_dir.resolve())
    config = peft_model.get_base_model().config
    typed_base = config._name_or_path
    with atomic_directory(adapter_dir, overwrite=True) as tmp:
        # PEFT's card names config._name_or_path as base_model: the unconverted base, on which the adapter
        # loads silently without the new weights; name the converted model it was trained on instead
        config._name_or_path = str(base_dir.resolve())
        try:
            peft_model.save_pretrained(str(tmp), safe_serialization=True, save_embedding_layers=False)
        finally:
            config._name_or_path = typed_base
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    merged = peft_model.merge_and_unload()
    state = merged.state_dict()
    changed = [k for k, v in base_sd.items() if k in state and not torch.equal(state[k], v)]
    trained = {k: state[k].detach().clone() for k in changed}
    with torch.no_grad():
        for k in changed:  # the model the adapter was trained on: save it, then put the trained values back
            state[k].copy_(base_sd[k])
        save(merged, base_dir, tokenizer=tokenizer, overwrite=True, card={
            "training": {"role": f"base of the PEFT adapter in {adapter_dir} (untrained new weights)"}})
        for k in changed:
            state[k].copy_(trained[k])
    return merged
