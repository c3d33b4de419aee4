"""What ships in ``configs/`` (imported as ``retrofit.configs``), sorted by kind.

    recipes        training recipes (a ``model:`` section): ``retrofit train NAME``
    convert specs  flat conversion specs (a ``method:`` key): ``retrofit convert MODEL --config NAME``
    datasets       entries of ``datasets.yaml``: ``retrofit eval ppl MODEL --datasets NAME``
    deepspeed      DeepSpeed JSON configs: a recipe's ``deepspeed.config``

Only file names and first comment lines are read (no heavy imports), for ``retrofit ls`` and
for error messages that list what exists.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["KINDS", "bundled_dir", "catalog", "recipe_names"]

KINDS = ("recipes", "convert specs", "datasets", "deepspeed")


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
    return out


def recipe_names(root: Path | None = None) -> list[str]:
    """Names of the bundled training recipes (``retrofit train NAME``)."""
    return [name for name, _ in catalog(root)["recipes"]]
