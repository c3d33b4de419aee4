"""The ``README.md`` model card that ``save`` writes into every converted folder.

Front matter (``library_name: retrofit``, ``base_model``, tags) as the Hugging Face hub reads it,
then what a reader needs: the base model, the method and its spec, which layers, how many new
weights, the training (data, steps, tokens) and held-out numbers when the caller knows them,
and how to load it (with retrofit imported, or through plain transformers, which refuses the
folder without retrofit).
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["model_card"]


def _yaml_value(value: Any) -> str:
    return json.dumps(value)  # JSON scalars and lists are valid YAML


def model_card(
    record: dict,
    *,
    model_type: str,
    new_parameters: int | None = None,
    total_parameters: int | None = None,
    training: dict | None = None,
    metrics: dict | None = None,
    adapter: str | None = None,
    path: str = "PATH",
) -> str:
    """Markdown with YAML front matter. ``training``: free-form facts (data, steps, tokens, recipe);
    ``metrics``: held-out numbers, e.g. ``{"held-out loss (nats/token)": 3.70}``."""
    base = record.get("base_model") or "unknown"
    method = record.get("method", "?")
    spec = {k: v for k, v in record.items() if k not in ("base_model", "toolkit_version", "converted_layers")}
    front = ["---", "library_name: retrofit", "pipeline_tag: text-generation",
             f"tags: {_yaml_value(['retrofit', 'linear-attention', method])}"]
    if record.get("base_model"):
        front.append(f"base_model: {_yaml_value(str(base))}")
    front.append("---")
    lines = [*front, "", f"# {method} retrofit of {base}", ""]
    lines += [
        f"`{base}` with its attention converted by [retrofit](https://pypi.org/project/retrofit/) "
        f"{record.get('toolkit_version', '')} to **{method}** (linear-time in the context length). Every "
        "pretrained weight is kept under its original name; the method's new weights are added beside them.",
        "",
        "| | |", "|---|---|",
        f"| base model | `{base}` |",
        f"| model_type | `{model_type}` (needs `pip install retrofit`; plain transformers refuses it) |",
        f"| method | `{method}` |",
        f"| spec | `{json.dumps(spec, sort_keys=True)}` |",
        f"| converted layers | {record.get('converted_layers', 'all')} |",
    ]
    if new_parameters is not None:
        total = f" of {total_parameters:,}" if total_parameters else ""
        lines.append(f"| new weights | {new_parameters:,} parameters{total} |")
    lines.append("")
    lines += ["## Training", ""]
    if training:
        lines += [f"- {k}: {v}" for k, v in training.items()]
    else:
        lines.append("Not trained yet: the new weights hold their initial values (`retrofit train` trains them).")
    lines.append("")
    if metrics:
        lines += ["## Held-out results", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()]
        lines.append("")
    lines += [
        "## Load", "",
        "```python",
        "import retrofit  # registers the retrofit_* model types with transformers",
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
        "",
        'model = AutoModelForCausalLM.from_pretrained("PATH")   # or: retrofit.load("PATH")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        'generate = pipeline("text-generation", model=model, tokenizer=tokenizer)',
        "```", "",
        "From a shell: `retrofit generate PATH --prompt ...`, "
        "`retrofit-lm-eval run --model hf --model_args pretrained=PATH --tasks ...`.",
    ]
    lines = [line.replace("PATH", path) for line in lines]
    if adapter:
        lines += ["", f"A PEFT LoRA adapter of this run is in `{adapter}` "
                      "(`peft.AutoPeftModelForCausalLM.from_pretrained` after `import retrofit`)."]
    return "\n".join(lines) + "\n"
