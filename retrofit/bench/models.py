"""The (base, converted) model pair that `retrofit bench decode` and `bench model` compare.

Without ``--model`` the base is a random Llama built from a config (no download): ``tiny``
(hidden 64, 2 layers, 4 heads, vocab 256) or ``small`` (hidden 256, 4 layers, 4 query / 2 KV
heads of dim 64, vocab 1024). The converted model is the base converted in memory with
``--method`` (or ``--converted PATH``, a saved checkpoint). Speed does not depend on the
weights' values, so random weights measure the same kernels a trained model would run.
"""
from __future__ import annotations

import argparse
import copy
import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["build_pair", "cache_bytes", "forward_kwargs"]

_TINY = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
}


def _tiny_base(size: str, max_len: int, seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**_TINY[size], max_position_embeddings=max(2048, max_len), bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def build_pair(args: argparse.Namespace, max_len: int) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    """``(base, converted, info)`` on ``args.device`` in ``args.dtype``, both in eval mode."""
    from retrofit.precision import cast_parameters
    from retrofit.surgery import ConversionSpec, convert, load_any, retrofit_record

    dtype = getattr(torch, args.dtype)
    if args.model:
        base, _ = load_any(args.model, dtype=dtype)
        name = str(args.model)
    else:
        base = cast_parameters(_tiny_base(args.tiny_size, max_len, args.seed), dtype)  # RoPE inv_freq stays fp32
        name = f"random Llama ({args.tiny_size}: {_describe(base)})"
    if args.converted:
        converted, _ = load_any(args.converted, dtype=dtype)
        conv_name = str(args.converted)
    else:
        from retrofit.bench.defaults import bench_latents
        from retrofit.layers.method import get_method

        keys = get_method(args.method).config.field_names()
        given = {"window": args.window, "latents": args.latents}
        method_keys = {k: v for k, v in given.items() if v is not None}  # a key the method lacks: SpecError
        if "latents" in keys and args.latents is None:
            method_keys["latents"] = bench_latents(None, int(base.config.num_attention_heads))
        spec = ConversionSpec(method=args.method, dtype=args.dtype, seed=args.seed, **method_keys)
        converted = convert(copy.deepcopy(base), spec)
        conv_name = f"{name} + convert({spec.resolved(converted.config).describe()})"
    for model in (base, converted):
        model.to(args.device).eval()
        if torch.device(args.device).type == "cpu":
            _into_process_memory(model)
    record = retrofit_record(converted) or {}
    info = {
        "base": name,
        "converted": conv_name,
        "method": record.get("method", args.method),
        "retrofit": {k: record.get(k) for k in ("method", "window", "latents", "layers") if k in record},
        "parameters": {"base": _count(base), "converted": _count(converted)},
    }
    return base, converted, info


def _into_process_memory(model: nn.Module) -> None:
    """Copy every weight into memory of this process. transformers maps a checkpoint's
    safetensors file and leaves the weights there: clean page-cache pages the kernel may drop
    between two calls and fault back in during the next, which then times a disk read and shows
    the weights (1 GiB for Gemma 3 270M in fp32) as step memory. Ties stay (a shared Parameter
    is one object)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _describe(model: nn.Module) -> str:
    c = model.config
    return (f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads} heads, "
            f"vocab {c.vocab_size}")


def forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """``logits_to_keep=1`` where the model takes it: prefill needs the last position's logits only."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def cache_bytes(cache: Any) -> int:
    """Bytes held by a transformers cache: retrofit layers report theirs, KV layers count keys + values."""
    total = 0
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "memory_bytes"):
            total += int(layer.memory_bytes())
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
