"""A converted model's ``retrofit`` record (config.json section, delta manifest) -> its spec, checked.

Below both ``checkpoint`` (which reads records from folders) and ``auto_classes`` (whose model
classes rebuild themselves from ``config.retrofit``), so neither imports the other for it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from retrofit.errors import CheckpointError, SpecError
from retrofit.surgery.fingerprint import SECTION_DIGEST_KEY, section_digest
from retrofit.surgery.spec import ConversionSpec

__all__ = ["check_section_digest", "spec_from_record"]


def spec_from_record(record: Any, where: str = "checkpoint") -> ConversionSpec:
    """The spec a record describes (``dtype`` left to the caller); ``CheckpointError`` if it is invalid."""
    if isinstance(record, dict):
        record = {k: v for k, v in record.items() if k != SECTION_DIGEST_KEY}
    try:
        spec = ConversionSpec.from_dict(record, allow_record_keys=True)
    except SpecError as exc:
        raise CheckpointError(f"{where}: its retrofit section is invalid: {exc}") from None
    return dataclasses.replace(spec, dtype=None)  # weights are loaded in the caller's dtype


def check_section_digest(record: dict, where: str) -> None:
    """The record's conversion fields still hash to the digest written with the weights (if any)."""
    recorded = record.get(SECTION_DIGEST_KEY)
    if recorded is not None and recorded != section_digest(record):
        raise CheckpointError(f"{where}: its retrofit section was edited after the weights were written (digest "
                              f"{recorded} recorded, {section_digest(record)} now); restore the original section "
                              "(method, window, latents, layers, ...) or convert and train again")
