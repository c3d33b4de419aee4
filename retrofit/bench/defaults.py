"""Defaults the benchmarks share (no torch): what ``--latents`` means and its default.

``--latents`` is L, the latent states **in total** over the query heads, everywhere: in
``retrofit convert``, ``bench decode``, ``bench model`` and ``bench attention`` (where it is
split over ``--heads``, L_h = L / heads). Unset, it is :data:`LATENTS_PER_HEAD` per query head.
The window default is the methods' (``retrofit.layers.method.DEFAULT_WINDOW``).
"""
from __future__ import annotations

from retrofit.errors import SpecError

__all__ = ["LATENTS_PER_HEAD", "bench_latents"]

LATENTS_PER_HEAD = 16


def bench_latents(latents: int | None, heads: int) -> int:
    """L in total: ``latents`` (checked to split over ``heads``), else ``LATENTS_PER_HEAD * heads``."""
    if latents is None:
        return LATENTS_PER_HEAD * heads
    if latents < 1 or latents % heads:
        raise SpecError(f"--latents {latents} is L in total and must split over the {heads} query heads; "
                        f"use a positive multiple of {heads} (e.g. {LATENTS_PER_HEAD * heads})")
    return latents
