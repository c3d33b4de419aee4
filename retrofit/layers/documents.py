"""Document boundaries of packed sequences: one padded row per document, and back.

Training packs documents end to end into fixed-length sequences. transformers' own packed
format says where each document starts through ``position_ids`` that restart (at 0) at every
document: a position that does not follow its predecessor by exactly one starts a new document
(the rule of ``transformers.masking_utils.find_packed_sequence_indices``). The model turns those
positions into each token's RoPE ``(cos, sin)``, so RoPE restarts by itself; what attention must
add is that no token reads another document.

Rather than teaching every method's kernels a new mask, a call with boundaries is regrouped:
:class:`DocumentBatch` cuts the ``(B, T)`` tokens into their documents, right-pads them into a
``(N, L)`` batch (one row per document, ``L`` the longest) with the padding mask ``valid``, the
layer runs its usual attention on that batch through the tested key-padding path, and
:meth:`DocumentBatch.merge` puts the real tokens back in their ``(B, T)`` places. Each document
is then computed exactly as if it ran alone: its window and its linear / latent state start
empty at its first token. The converted layers (:class:`retrofit.layers.base.RetrofitAttention`,
every method) and the softmax layers a conversion keeps (``retrofit.patches.attention``) both go
through :func:`packed_documents`.

Boundaries are read only where transformers reads them: a call without a padding mask (packing
and padding are not combined) and without a decoding cache (a cache holds one stream per row; a
converted layer refuses boundaries with one). Under ``torch.compile`` no boundary is looked for
(it is a data-dependent branch; compiled decoding steps one token at a time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DocumentBatch", "document_starts", "packed_documents"]


def document_starts(position_ids: torch.Tensor | None, batch_size: int, num_tokens: int) -> torch.Tensor | None:
    """``(B, T)`` bool, True at each token that starts a document after a row's first token (its
    position is not its predecessor's plus one); None when no row has one. ``position_ids``
    ``(B or 1, T)``; anything else (None, another length, one token) has no boundaries."""
    if position_ids is None or num_tokens < 2 or position_ids.ndim != 2 or position_ids.shape[-1] != num_tokens:
        return None
    if torch.compiler.is_compiling():
        return None
    starts = torch.zeros(position_ids.shape, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = (position_ids[:, 1:] - position_ids[:, :-1]) != 1
    if not bool(starts.any()):
        return None
    return starts.expand(batch_size, num_tokens)


@dataclass
class DocumentBatch:
    """The documents of a packed ``(B, T)`` batch as a right-padded ``(N, L)`` batch.

    ``index`` ``(N, L)``: each document token's place in the flattened ``B * T`` tokens (padding
    repeats the document's first token, so every value stays finite); ``valid`` ``(N, L)``: False
    at padding. Documents are in reading order (row by row), so the real tokens of the regrouped
    batch, read in order, are the ``B * T`` tokens in order: :meth:`merge` is a masked select.
    """

    index: torch.Tensor
    valid: torch.Tensor
    batch_size: int
    num_tokens: int

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> "DocumentBatch":
        """From ``(B, T)`` bool document starts (a row's first token always starts one)."""
        B, T = starts.shape
        flat = starts.clone()
        flat[:, 0] = True
        flat = flat.reshape(-1)
        first = flat.nonzero().squeeze(1)  # (N,) each document's first token
        lengths = torch.diff(first, append=first.new_full((1,), B * T))
        longest = int(lengths.max())
        offsets = torch.arange(longest, device=starts.device)
        valid = offsets[None, :] < lengths[:, None]
        index = torch.where(valid, first[:, None] + offsets[None, :], first[:, None])
        return cls(index, valid, B, T)

    @property
    def num_documents(self) -> int:
        return int(self.index.shape[0])

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x`` with batch dim 0 (``B`` or 1) and time dim ``dim`` (``T``) -> the same with ``(N, L)``."""
        x = x.expand(self.batch_size, *x.shape[1:]) if x.shape[0] == 1 and self.batch_size > 1 else x
        moved = x.movedim(dim, 1)
        rest = moved.shape[2:]
        flat = moved.reshape(self.batch_size * self.num_tokens, *rest)
        out = flat.index_select(0, self.index.reshape(-1)).view(*self.index.shape, *rest)
        return out.movedim(1, dim)

    def merge(self, y: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`split` on the real tokens: ``(N, ..., L, ...)`` -> ``(B, ..., T, ...)``."""
        moved = y.movedim(dim, 1)
        rest = moved.shape[2:]
        real = moved[self.valid]  # (B * T, *rest), in the packed order
        return real.view(self.batch_size, self.num_tokens, *rest).movedim(1, dim)


def packed_documents(position_ids: torch.Tensor | None, batch_size: int, num_tokens: int,
                     attention_mask: Any = None, cache: Any = None) -> DocumentBatch | None:
    """The documents of a call whose ``position_ids`` restart inside a row, or None (no boundary, a
    padding mask given, ...). With a decoding ``cache`` (not None) and boundaries: ValueError."""
    if attention_mask is not None:
        return None
    starts = document_starts(position_ids, batch_size, num_tokens)
    if starts is None:
        return None
    if cache is not None:
        raise ValueError("position_ids restart inside a sequence (packed documents) but a decoding cache was "
                         "passed: a cache holds one stream per row, so read packed documents without one "
                         "(use_cache=False)")
    return DocumentBatch.from_starts(starts)
