"""Cheap fingerprints of frozen base weights and of a retrofit section.

A weight fingerprint holds a digest of the tensors' names and shapes, a few values of each
tensor (``SAMPLES`` evenly spaced elements, as float32) and a row digest per tensor: one
element of every row (every element of a 1-D tensor) at a column drawn from a fixed seed,
rounded to bfloat16 and hashed, so one changed embedding row is caught. It costs one gather per
tensor (a few values per row), so it is taken at every save and checked on every resume and
delta attach. Sampled values compare with a relative tolerance of 1e-2 and row digests exactly
when both sides are fp32 or bf16 (bf16 rounding of an fp32 value is the same either way): the
same base loaded in another dtype still matches; a different, retrained or edited base does not.

A tokenizer digest hashes what turns text into ids (the vocabulary, merges, normaliser and
pre-tokeniser, added tokens): a tokenizer swapped at the same path no longer matches.

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

__all__ = [
    "FORMAT", "SAMPLES", "weights_fingerprint", "compare_fingerprints", "section_digest", "SECTION_DIGEST_KEY",
    "tokenizer_digest", "unreadable_format",
]

FORMAT = "retrofit-fingerprint/2"
SAMPLES = 8
_ROW_SEED = 20240917
_EXACT_DTYPES = ("float32", "bfloat16")  # their bf16 roundings of one base agree
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


@torch.no_grad()
def _row_digest(t: torch.Tensor) -> str:
    """sha256 (16 hex) of one seeded element per row (all of a 1-D tensor), rounded to bfloat16."""
    t = t.detach()
    if t.dim() < 2:
        picked = t.reshape(-1)
    else:
        rows = t.reshape(t.shape[0], -1)
        gen = torch.Generator().manual_seed(_ROW_SEED)
        cols = torch.randint(rows.shape[1], (rows.shape[0],), generator=gen).to(t.device)
        picked = rows.gather(1, cols[:, None]).reshape(-1)
    data = picked.to(torch.bfloat16).cpu().view(torch.int16).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _dtype_name(names: list[str], params: dict) -> str:
    dtypes = {str(params[n].dtype).replace("torch.", "") for n in names}
    return dtypes.pop() if len(dtypes) == 1 else "mixed"


def weights_fingerprint(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Fingerprint of the parameters ``names`` (default: all) of ``model``.

    Returns ``{"format", "tensors", "shapes": sha256 of the sorted (name, shape) pairs, "samples":
    {name: [SAMPLES floats]}, "rows": {name: row digest}, "dtype"}``. ZeRO-3 partitioned
    parameters must be gathered by the caller.
    """
    params = dict(model.named_parameters())
    chosen = sorted(params if names is None else names)
    shapes = [(n, list(params[n].shape)) for n in chosen]
    return {
        "format": FORMAT,
        "tensors": len(chosen),
        "shapes": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16],
        "samples": {n: _sample(params[n]) for n in chosen},
        "rows": {n: _row_digest(params[n]) for n in chosen},
        "dtype": _dtype_name(chosen, params),
    }


def _compare_rows(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """What the row digests say differs (None where they agree or cannot be compared exactly)."""
    if recorded.get("dtype") != current.get("dtype") and not {recorded.get("dtype"), current.get("dtype")} <= set(_EXACT_DTYPES):
        return None
    theirs, mine = recorded.get("rows") or {}, current.get("rows") or {}
    for name in sorted(mine):
        if theirs.get(name) != mine[name]:
            return f"the values of {name} differ (at least one row changed)"
    return None


def unreadable_format(recorded: Mapping[str, Any] | None) -> str | None:
    """Why a recorded fingerprint cannot be compared at all (None if it can): this version reads :data:`FORMAT` only."""
    if not recorded or recorded.get("format") == FORMAT:
        return None
    return (f"its base fingerprint has format {recorded.get('format')!r}, which this version does not read "
            f"(only {FORMAT!r}; an earlier format comes from a pre-release retrofit)")


def compare_fingerprints(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """None if ``current`` matches ``recorded`` (or nothing was recorded); else what differs. Callers
    refuse a recorded fingerprint of another format first (:func:`unreadable_format`)."""
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
    return _compare_rows(recorded, current)


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 (16 hex) of what maps text to ids: the fast tokenizer's model, normaliser, pre-tokeniser
    and added tokens, or the vocabulary and special tokens of a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        content = {k: spec.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}
    else:
        proto = getattr(getattr(tokenizer, "sp_model", None), "serialized_model_proto", None)
        vocab = proto().hex() if callable(proto) else sorted(tokenizer.get_vocab().items())
        content = {"vocab": vocab}
    content["special"] = {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]


def section_digest(record: Mapping[str, Any]) -> str:
    """Hash of a retrofit record's conversion fields (everything but dtype, version, base id, the digest)."""
    fields = {k: record[k] for k in sorted(record) if k not in _NOT_SPEC}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
