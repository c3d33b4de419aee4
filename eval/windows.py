"""Token windows for perplexity: the evaluation protocol, shared by the model and its baseline.

Two protocols (``--protocol``):

``windows`` (PG-19 style, the default for book corpora)
    Each document is tokenized on its own (no special tokens). A window of length L is
    ``[BOS] + body[i*n : (i+1)*n]`` with ``n = L - 1`` when BOS is used (else ``n = L``): windows
    are non-overlapping and lie inside one document; documents shorter than ``n`` tokens give
    none. The model input is exactly L tokens.
``packed`` (for corpora of short documents: SlimPajama, Pile, OWT, TinyStories)
    Documents are joined into one token stream, each followed by EOS (and BOS when used), and
    the stream is cut into consecutive windows ``[BOS] + stream[i*n : (i+1)*n]``.

With a cap of ``max_windows`` per length, windows are taken round-robin over documents
(window 0 of every document, then window 1, ...), so a few long books do not crowd out the
rest. Perplexity is ``exp(sum NLL / number of predicted tokens)`` over the L-1 next-token
predictions of every window of a length (the first input token is never a target).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from retrofit.errors import DataError
from retrofit.eval.corpora import Document


@dataclass(frozen=True)
class Window:
    """One evaluation window: ``input_ids`` [L] (BOS included), and where its body starts."""

    doc_id: str
    start: int
    input_ids: torch.Tensor

    def describe(self) -> dict:
        return {"doc": self.doc_id, "start": self.start, "length": int(self.input_ids.numel())}


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (silences the "longer than max length" warning)."""
    tf_logger = logging.getLogger("transformers.tokenization_utils_base")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    finally:
        tf_logger.setLevel(level)


def encode_prefix(tokenizer, text: str, max_tokens: int | None, *, chunk_chars: int = 32_768) -> list[int]:
    """Token ids of (at least) the first ``max_tokens`` tokens of ``text``; all of it if None.

    Long documents are encoded a paragraph-aligned chunk at a time (the same chunks whatever
    ``max_tokens`` is, so windows do not depend on the cap) and encoding stops once enough
    tokens exist: a capped sweep does not tokenize whole books.
    """
    if len(text) <= chunk_chars:
        return encode(tokenizer, text)
    ids: list[int] = []
    pos = 0
    while pos < len(text) and (max_tokens is None or len(ids) < max_tokens):
        end = min(len(text), pos + chunk_chars)
        if end < len(text):
            cut = text.rfind("\n\n", pos + chunk_chars // 2, end)
            end = cut + 2 if cut != -1 else end
        ids.extend(encode(tokenizer, text[pos:end]))
        pos = end
    return ids


def build_windows(
    docs: Iterable[Document],
    tokenizer,
    lengths: list[int],
    *,
    protocol: str = "windows",
    max_windows: int | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> dict[int, list[Window]]:
    """Cut documents into token windows of each length: ``{length: [Window, ...]}``.

    Reads ``docs`` lazily and stops as soon as every length has its ``max_windows`` (for
    ``windows``: from at least ``max_windows`` distinct documents where the corpus allows).
    """
    lengths = sorted(set(int(x) for x in lengths))
    prefix = [bos_id] if bos_id is not None else []
    min_len = len(prefix) + 2
    for L in lengths:
        if L < min_len:
            raise DataError(f"window length {L} is too short: need at least {min_len} tokens")
    if max_windows is not None and max_windows < 1:
        raise DataError("max_windows must be at least 1")
    if protocol == "windows":
        return _doc_windows(docs, tokenizer, lengths, prefix, max_windows)
    if protocol == "packed":
        return _packed_windows(docs, tokenizer, lengths, prefix, max_windows, bos_id, eos_id)
    raise DataError(f"protocol {protocol!r} is not one of windows, packed")


def _make(prefix: list[int], body: list[int], doc_id: str, start: int) -> Window:
    return Window(doc_id, start, torch.tensor(prefix + body, dtype=torch.long))


def _doc_windows(docs, tokenizer, lengths, prefix, max_windows) -> dict[int, list[Window]]:
    per_doc: list[tuple[str, list[int]]] = []
    eligible = {L: 0 for L in lengths}  # documents with at least one window of length L
    available = {L: 0 for L in lengths}  # windows of length L over all documents read
    need = None if max_windows is None else max_windows * (max(lengths) - len(prefix))
    for doc in docs:
        ids = encode_prefix(tokenizer, doc.text, need)
        per_doc.append((doc.doc_id, ids))
        for L in lengths:
            k = len(ids) // (L - len(prefix))
            available[L] += k
            eligible[L] += k > 0
        if max_windows is not None and all(eligible[L] >= max_windows for L in lengths):
            break
    out: dict[int, list[Window]] = {}
    for L in lengths:
        n = L - len(prefix)
        queues = [[(doc_id, i * n) for i in range(len(ids) // n)] for doc_id, ids in per_doc]
        chosen: list[tuple[str, int]] = []
        rank = 0
        while any(rank < len(q) for q in queues):
            for q in queues:
                if rank < len(q):
                    chosen.append(q[rank])
            rank += 1
            if max_windows is not None and len(chosen) >= max_windows:
                break
        chosen = chosen[:max_windows] if max_windows is not None else chosen
        tokens = dict(per_doc)
        out[L] = [_make(prefix, tokens[d][s : s + n], d, s) for d, s in chosen]
    return out


def _packed_windows(docs, tokenizer, lengths, prefix, max_windows, bos_id, eos_id) -> dict[int, list[Window]]:
    sep = ([eos_id] if eos_id is not None else []) + ([bos_id] if bos_id is not None else [])
    stream: list[int] = []
    starts: list[tuple[int, str]] = []  # (stream offset, doc id) where each document begins
    need = None if max_windows is None else max_windows * (max(lengths) - len(prefix))
    for doc in docs:
        starts.append((len(stream), doc.doc_id))
        stream.extend(encode_prefix(tokenizer, doc.text, None if need is None else need - len(stream)))
        stream.extend(sep)
        if need is not None and len(stream) >= need:
            break
    out: dict[int, list[Window]] = {}
    for L in lengths:
        n = L - len(prefix)
        k = len(stream) // n
        if max_windows is not None:
            k = min(k, max_windows)
        wins = []
        d = 0
        for i in range(k):
            while d + 1 < len(starts) and starts[d + 1][0] <= i * n:
                d += 1
            wins.append(_make(prefix, stream[i * n : (i + 1) * n], starts[d][1], i * n))
        out[L] = wins
    return out
