"""Continual pretraining of converted models (DeepSpeed through accelerate), driven by YAML recipes.

    from retrofit.train import load_recipe, train
    result = train(load_recipe("configs/gemma3-270m-macchiato-cpu.yaml", ["train.max_steps=50"]))

Modules: ``recipe`` (schema, overrides), ``trainable`` (what trains), ``distributed`` (launch
and DeepSpeed config), ``schedule`` (LR), ``memory`` (sequence-length check),
``checkpointing`` (atomic checkpoints), ``metrics`` (jsonl / TensorBoard / W&B), ``loop`` (one
recipe's run), ``stages`` (a staged recipe's runs) and ``entry`` (``train``: either).
"""
from __future__ import annotations

__all__ = ["Recipe", "load_recipe", "train", "TrainCallback", "TrainResult"]


def __getattr__(name: str):  # lazy: importing retrofit.train must not import DeepSpeed
    if name in ("Recipe", "load_recipe"):
        from retrofit.train import recipe

        return getattr(recipe, name)
    if name == "train":
        from retrofit.train import entry

        return entry.train
    if name in ("TrainCallback", "TrainResult"):
        from retrofit.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'retrofit.train' has no attribute {name!r}")
