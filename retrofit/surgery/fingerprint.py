"""Cheap fingerprints of frozen base weights and of a retrofit section.

A weight fingerprint holds a digest of the tensors' names and shapes and a few values of each
tensor (``SAMPLES`` evenly spaced elements, as float32). It costs one strided read per tensor,
so it is taken at every save and checked on every resume and delta attach. Values compare with
a relative tolerance of 1e-2: the same base loaded in another dtype (fp32 vs bf16/fp16) still
matches; a different or retrained base does not (its values differ by far more).

A section digest is a hash of the conversion fields of a ``retrofit`` record (method,
hyper-parameters, layers, options): an edited ``config.json`` (say ``window`` 8 -> 64) no
longer matches the digest recorded when the weights were written.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Iterable, Mapping

import torch
from torch import nn

__all__ = ["FORMAT", "SAMPLES", "weights_fingerprint", "compare_fingerprints", "section_digest", "SECTION_DIGEST_KEY"]

FORMAT = "retrofit-fingerprint/1"
SAMPLES = 8
SECTION_DIGEST_KEY = "section_digest"
_NOT_SPEC = {"dtype", "toolkit_version", "base_model", SECTION_DIGEST_KEY}
_RTOL, _ATOL = 1e-2, 1e-6


@torch.no_grad()
def _sample(t: torch.Tensor) -> list[float]:
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return []
    k = min(SAMPLES, n)
    idx = (torch.arange(k, dtype=torch.int64) * (n - 1)) // max(k - 1, 1)  # evenly spaced, exact integers
    return [float(v) for v in flat[idx.to(flat.device)].float().cpu()]


def weights_fingerprint(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Fingerprint of the parameters ``names`` (default: all) of ``model``.

    Returns ``{"format", "tensors", "shapes": sha256 of the sorted (name, shape) pairs, "samples":
    {name: [SAMPLES floats]}}``. ZeRO-3 partitioned parameters must be gathered by the caller.
    """
    params = dict(model.named_parameters())
    chosen = sorted(params if names is None else names)
    shapes = [(n, list(params[n].shape)) for n in chosen]
    return {
        "format": FORMAT,
        "tensors": len(chosen),
        "shapes": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16],
        "samples": {n: _sample(params[n]) for n in chosen},
    }


def compare_fingerprints(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """None if ``current`` matches ``recorded`` (or nothing was recorded); else what differs."""
    if not recorded:
        return None
    if recorded.get("format") != FORMAT:
        return f"unknown fingerprint format {recorded.get('format')!r}"
    if recorded.get("tensors") != current.get("tensors") or recorded.get("shapes") != current.get("shapes"):
        return (f"the tensors' names or shapes differ ({recorded.get('tensors')} recorded, "
                f"{current.get('tensors')} now)")
    theirs, mine = recorded.get("samples") or {}, current.get("samples") or {}
    for name in sorted(mine):
        a, b = theirs.get(name), mine[name]
        if a is None or len(a) != len(b):
            return f"{name} was not fingerprinted the same way"
        for x, y in zip(a, b):
            if not (math.isfinite(x) and math.isfinite(y)):
                if not (x == y or (math.isnan(x) and math.isnan(y))):
                    return f"the values of {name} differ"
            elif abs(x - y) > _ATOL + _RTOL * max(abs(x), abs(y)):
                return f"the values of {name} differ (e.g. {x:.6g} recorded, {y:.6g} now)"
    return None


def section_digest(record: Mapping[str, Any]) -> str:
    """Hash of a retrofit record's conversion fields (everything but dtype, version, base id, the digest)."""
    fields = {k: record[k] for k in sorted(record) if k not in _NOT_SPEC}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
