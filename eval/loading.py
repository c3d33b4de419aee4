"""Loading models for evaluation, and the few model facts the evaluators need.

Everything goes through :func:`load_model`, which defers to ``retrofit.surgery.load_any`` (a
converted folder, a base HF folder or hub id, a GGUF file, or the alias ``gemma3-270m``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from retrofit.data import bos
from retrofit.errors import CheckpointError, RetrofitError

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_model(name_or_path: str, *, device: str = "cpu", dtype: str | None = None) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for evaluation, in eval mode on ``device``.

    ``dtype`` is None (keep what the checkpoint loads as), one of float32/bfloat16/float16, or
    ``auto`` (:func:`retrofit.precision.auto_dtype_name` for ``device``).
    """
    import torch

    from retrofit.precision import auto_dtype_name, cast_parameters
    from retrofit.surgery import load_any

    if dtype is not None and dtype not in _DTYPES:
        raise RetrofitError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    if dtype == "auto":
        dtype = auto_dtype_name(device)
    model, tokenizer = load_any(name_or_path, dtype=getattr(torch, dtype) if dtype is not None else None)
    if tokenizer is None:
        raise CheckpointError(
            f"{name_or_path} has no tokenizer stored with it; save the tokenizer into the folder "
            f"(retrofit.surgery.save(..., tokenizer=tok)) or pass a loaded model with tokenizer= in Python"
        )
    if dtype is not None:  # parameters only: RoPE inv_freq buffers keep their fp32 (see cast_parameters)
        cast_parameters(model, getattr(torch, dtype))
    model = model.to(device)
    model.eval()
    return model, tokenizer


def resolve(
    model: Any, tokenizer: Any = None, *, device: str = "cpu", dtype: str | None = None, rope_cap: int | None = None
) -> tuple[Any, Any, str]:
    """``model`` is a name/path (loaded here) or a loaded model (then ``tokenizer`` is required).

    ``rope_cap``: cap the RoPE distance of the model's full-attention layers at this many tokens
    (:func:`retrofit.surgery.rope_cap.cap_rope`; 0 removes a cap; None leaves the model as it is).
    Returns ``(model, tokenizer, label)``; the label names the model in tables.
    """
    if isinstance(model, (str, Path)):
        m, tok = load_model(str(model), device=device, dtype=dtype)
        apply_rope_cap(m, rope_cap)
        label = describe_model(m, str(model))
        m._retrofit_eval_label = label  # later resolve() calls on this object keep the name
        return m, (tokenizer if tokenizer is not None else tok), label
    if tokenizer is None:
        raise RetrofitError("pass the tokenizer together with an already-loaded model")
    apply_rope_cap(model, rope_cap)
    model.eval()
    label = getattr(model, "_retrofit_eval_label", None)
    if label is None:
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
        label = describe_model(model, name)
    return model, tokenizer, label


def _rope_caps(model: Any) -> dict[str, int] | None:
    """``{layer: cap}`` of the model's capped full-attention layers (results files), or None."""
    from retrofit.surgery.rope_cap import capped_layers

    caps = capped_layers(model)
    return {str(k): v for k, v in caps.items()} or None


def _rope_scaling(model: Any) -> dict | None:
    from retrofit.surgery.rope_scaling import rope_scaling_of

    return rope_scaling_of(model)


def _latent_path_closed(model: Any) -> bool | None:
    """True when every closable layer's latent path (``latent_path_closed``: a window method's, LAVO's) is
    closed, None for models without one."""
    flags = [bool(m.latent_path_closed) for m in model.modules() if hasattr(m, "latent_path_closed")]
    return all(flags) if flags else None


def apply_rope_cap(model: Any, rope_cap: int | None) -> None:
    """Cap (or with 0 un-cap) the model's full-attention RoPE distances; None leaves it as it is."""
    if rope_cap is None:
        return
    from retrofit.surgery.rope_cap import cap_rope

    cap_rope(model, rope_cap)  # validated there: a bad value is one SpecError


def model_label(name: str) -> str:
    """A short display name: the last path component (``runs/x/converted`` -> ``converted``)."""
    name = str(name).rstrip("/")
    return Path(name).name if ("/" in name and Path(name).exists()) else name


def describe_model(model: Any, name: str) -> str:
    """What a model is, for tables and plots: a base by its name; a converted model as base + method +
    converted layers + its key hyper-parameters + training (``runs/x/final`` -> ``smollm2-135m +
    macchiato (30/30 layers, w 1024, L 144, 4 sinks), 120 steps / 491,520 tokens``). The folder
    stays in results.json (``name_or_path``)."""
    section = retrofit_section(model)
    if not section or "method" not in section:
        return model_label(name)
    base = model_label(str(section.get("base_model") or "?"))
    total = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    layers = section.get("converted_layers")
    parts = [f"{len(layers)}/{total} layers" if isinstance(layers, list) and total else None]
    for key, short in (("window", "w"), ("latents", "L"), ("segment", "s")):
        if section.get(key) is not None:
            parts.append(f"{short} {section[key]}")
    if section.get("sinks"):
        parts.append(f"{section['sinks']} sinks")
    label = f"{base} + {section['method']} ({', '.join(p for p in parts if p)})"
    return label + _training_suffix(Path(name))


def _training_suffix(folder: Path) -> str:
    """``, 120 steps / 491,520 tokens`` from a saved folder's training facts, ``, untrained`` when its
    model card says it was never trained, else nothing (a folder written before training facts)."""
    from retrofit.surgery.checkpoint import TRAINING_FACTS

    if not folder.is_dir():
        return ""
    facts_file = folder / TRAINING_FACTS
    if not facts_file.is_file():  # the card says so of a folder saved before any training
        card = folder / "README.md"
        untrained = card.is_file() and "Not trained yet" in card.read_text(errors="replace")
        return ", untrained" if untrained else ""
    try:
        import json

        facts = json.loads(facts_file.read_text()).get("training", {})
    except (OSError, ValueError, AttributeError):
        return ""
    steps, tokens = facts.get("optimizer steps"), facts.get("training tokens")
    if steps is None:
        return ""
    return f", {steps} steps" + (f" / {tokens} tokens" if tokens else "")


def retrofit_section(model: Any) -> dict | None:
    """The config's ``retrofit`` section (method, hyper-parameters) if the model is converted."""
    section = getattr(getattr(model, "config", None), "retrofit", None)
    if section is None:
        return None
    return dict(section) if isinstance(section, dict) else {"value": str(section)}


def is_converted(model: Any) -> bool:
    return retrofit_section(model) is not None


def _has_native_window(config: Any) -> bool:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None) or ()
    return any(t == "sliding_attention" for t in types) or bool(getattr(config, "sliding_window", None))


@contextlib.contextmanager
def scoring_attention(model: Any) -> Iterator[str | None]:
    """Run an unconverted model of a supported family under the ``"retrofit"`` attention while scoring.

    Its native sliding-window layers then take the O(T w) blocked kernel in a chunked forward
    instead of SDPA over every cached key (Gemma 3: 4096 queries x 4607 keys for a 512 window,
    9x the work); the other layers run SDPA as before, so the numbers agree to float rounding.
    Models already converted, without a native window, of an unknown family, or under another
    implementation (flash-attention on GPU) are left alone. The implementation is restored on
    exit. Yields the implementation in use (for results files).
    """
    from retrofit.patches import find_family
    from retrofit.patches.attention import install_attention_function

    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if (
        config is None or is_converted(model) or current not in ("sdpa", "eager")
        or find_family(model) is None or not _has_native_window(config)
    ):
        yield current
        return
    model.set_attn_implementation(install_attention_function())
    try:
        yield "retrofit"
    finally:
        model.set_attn_implementation(current)


def model_info(model: Any, label: str) -> dict:
    """JSON-friendly description of a model for results files."""
    cfg = getattr(model, "config", None)
    n_params = sum(p.numel() for p in model.parameters())
    info = {
        "label": label,
        "name_or_path": getattr(cfg, "_name_or_path", None),
        "model_type": getattr(cfg, "model_type", None),
        "converted": is_converted(model),
        "rope_cap": _rope_caps(model),
        "rope_scaling": _rope_scaling(model),
        "latent_path_closed": _latent_path_closed(model),
        "parameters": n_params,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
    }
    if is_converted(model):
        info["retrofit"] = retrofit_section(model)
    return info


def needs_bos(model: Any, tokenizer: Any, policy: str = "auto") -> bool:
    """Whether to start every evaluated sequence with BOS (:func:`retrofit.data.bos.needs_bos`)."""
    return bos.needs_bos(tokenizer, policy, family_needs_bos=family_needs_bos(model))


def family_needs_bos(model: Any) -> bool:
    """Whether the model's family needs BOS even where its tokenizer does not add it (the family
    table's ``needs_bos``: Gemma's quality collapses without BOS, and tokenizers rebuilt from GGUF
    do not always say so)."""
    from retrofit.patches import find_family

    family = find_family(getattr(model, "config", None))
    return bool(family and family.needs_bos)


def check_same_tokenizer(tok_a: Any, tok_b: Any, label_a: str = "model", label_b: str = "baseline") -> None:
    """Refuse to compare two models whose tokenizers disagree (the token windows would differ)."""
    probe = "The quick brown fox, 1234 times: naïve déjà-vu!\n\tEnd."
    a = tok_a(probe, add_special_tokens=False)["input_ids"]
    b = tok_b(probe, add_special_tokens=False)["input_ids"]
    if a != b or len(tok_a) != len(tok_b):
        raise RetrofitError(
            f"{label_a} and {label_b} tokenize text differently (vocab {len(tok_a)} vs {len(tok_b)}); "
            f"perplexities would not be comparable. Use a baseline with the same tokenizer."
        )
