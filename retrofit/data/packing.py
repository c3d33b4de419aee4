"""Tokenise documents and pack them into fixed-length training sequences, resumably.

Each document becomes ``tokenizer(text)`` (with the tokenizer's own special tokens, e.g.
Gemma's BOS) followed by one EOS; documents are concatenated and cut into blocks of
``seq_len`` tokens, so a block may span a document boundary and no token is dropped or
repeated except the unfinished tail when the stream ends. With ``bos_id`` every block starts
with BOS: a block that does not begin at a document's own BOS gets one prepended and takes
``seq_len - 1`` stream tokens (models pretrained with BOS at position 0, like Gemma, lose about
a nat per token on windows without it). :func:`document_positions` recovers where each document
starts in a block (after each EOS), as position ids that restart there. A shuffle buffer of packed blocks mixes neighbouring
blocks (long books would otherwise fill whole batches).

:class:`PackedSequences` is exactly resumable: ``state_dict()`` holds the document stream's
position (``datasets`` streaming state), the unfinished tail, the shuffle buffer and its
RNG, so ``load_state_dict`` continues with the very next block an uninterrupted run would
have produced.
"""
from __future__ import annotations

import copy
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch

from retrofit.data.bos import sequence_bos  # re-exported: the old import path
from retrofit.errors import DataError

__all__ = ["PackedSequences", "pack_tokens", "take_block", "make_tokenize", "eval_blocks", "sequence_bos",
           "document_positions"]


def make_tokenize(tokenizer: Any, special_tokens: bool = True) -> Callable[[str], list[int]]:
    """``text -> token ids``, no length warning; with the tokenizer's special tokens (BOS where it
    adds one) unless ``special_tokens`` is False (a snippet spliced into running text)."""

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=special_tokens, verbose=False)["input_ids"])

    return tokenize


def document_positions(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids of packed blocks ``ids`` ``(..., T)`` that restart at 0 at each document: the
    token after every EOS starts one (packing ends each document with EOS), as does a block's first
    token. This is transformers' packed-sequence format: the model's RoPE restarts with them and
    the attention layers read each document alone (:mod:`retrofit.layers.documents`)."""
    T = ids.shape[-1]
    index = torch.arange(T, device=ids.device).expand(ids.shape)
    start = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    start[..., 1:] = ids[..., :-1] == eos_id
    first = torch.where(start, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def take_block(stream: np.ndarray, seq_len: int, bos_id: int | None) -> tuple[np.ndarray | None, np.ndarray]:
    """``(block, rest)``: the next full block from the front of ``stream`` (None if too short) and the rest."""
    prefix = bos_id is not None and (len(stream) == 0 or stream[0] != bos_id)
    take = seq_len - 1 if prefix else seq_len
    if len(stream) < take:
        return None, stream
    block = np.concatenate([[bos_id], stream[:take]]).astype(np.int64) if prefix else stream[:take].copy()
    return block, stream[take:]


def pack_tokens(docs: Iterator[list[int]], seq_len: int, eos_id: int, bos_id: int | None = None) -> Iterator[np.ndarray]:
    """Plain (non-resumable) packing: ``doc + [eos]`` concatenated and cut into ``seq_len`` blocks."""
    carry = np.zeros(0, dtype=np.int64)
    for ids in docs:
        carry = np.concatenate([carry, np.asarray(ids, dtype=np.int64), [eos_id]])
        block, carry = take_block(carry, seq_len, bos_id)
        while block is not None:
            yield block
            block, carry = take_block(carry, seq_len, bos_id)


class PackedSequences:
    """Iterator of ``(seq_len,)`` int64 token blocks from a document stream (one data-parallel rank).

    Args:
        documents: a ``datasets.IterableDataset`` of this rank's documents (see ``shard_documents``).
        tokenize: ``text -> ids``; ``eos_id`` is appended to every document.
        seq_len: tokens per block.
        bos_id: start every block with this token (see the module docstring); None: plain cuts.
        shuffle_buffer: blocks held for shuffling (0 or 1: stream order).
        seed: seeds the shuffle buffer's RNG.
        repeat: start another pass over the documents when they run out (epoch += 1).
        text_field: the documents' text column.
    """

    def __init__(
        self,
        documents: Any,
        tokenize: Callable[[str], list[int]],
        *,
        seq_len: int,
        eos_id: int,
        bos_id: int | None = None,
        shuffle_buffer: int = 0,
        seed: int = 0,
        repeat: bool = True,
        text_field: str = "text",
    ):
        if eos_id is None:
            raise DataError("the tokenizer has no EOS token: packing needs one between documents")
        if seq_len < 2:
            raise DataError(f"seq_len must be >= 2, got {seq_len}")
        self.documents = documents
        self.tokenize = tokenize
        self.seq_len = int(seq_len)
        self.eos_id = int(eos_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.shuffle_buffer = int(shuffle_buffer)
        self.repeat = repeat
        self.text_field = text_field
        self._fresh_doc_state = copy.deepcopy(documents.state_dict())
        self._doc_state: dict | None = None  # where to restart the document stream (None: from the start)
        self._carry = np.zeros(0, dtype=np.int64)
        self._pool: list[np.ndarray] = []
        self._rng = random.Random(seed)
        self.epoch = 0
        self.blocks_yielded = 0
        self._iterating = False

    # ------------------------------------------------------------------ iteration
    def _documents(self) -> Iterator[dict]:
        """Document stream from the saved position, then further passes if ``repeat``."""
        while True:
            fresh = self._doc_state is None
            self.documents.load_state_dict(copy.deepcopy(self._fresh_doc_state if fresh else self._doc_state))
            if hasattr(self.documents, "set_epoch"):
                self.documents.set_epoch(self.epoch)
            self._doc_state = None
            produced = False
            for doc in self.documents:
                produced = True
                yield doc
            if not self.repeat:
                return
            if fresh and not produced:
                raise DataError("this rank's share of the data holds no document: give at least as many "
                                "documents (files, for local txt) as data-parallel ranks")
            self.epoch += 1

    def _blocks(self) -> Iterator[np.ndarray]:
        for doc in self._documents():
            text = doc.get(self.text_field) if isinstance(doc, dict) else None
            if text is None:
                keys = ", ".join(doc) if isinstance(doc, dict) else type(doc).__name__
                raise DataError(f"documents have no {self.text_field!r} field (fields: {keys}); set data.text_field")
            ids = self.tokenize(text)
            self._carry = np.concatenate([self._carry, np.asarray(ids, dtype=np.int64), [self.eos_id]])
            # one block at a time: while suspended at a yield, the carry holds exactly what is not yet yielded
            block, self._carry = take_block(self._carry, self.seq_len, self.bos_id)
            while block is not None:
                yield block
                block, self._carry = take_block(self._carry, self.seq_len, self.bos_id)

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._iterating:
            raise RuntimeError("PackedSequences supports one iterator at a time")
        self._iterating = True
        try:
            for block in self._blocks():
                if self.shuffle_buffer <= 1:
                    self.blocks_yielded += 1
                    yield torch.from_numpy(block)
                    continue
                if len(self._pool) < self.shuffle_buffer:
                    self._pool.append(block)
                    continue
                i = self._rng.randrange(len(self._pool))
                out, self._pool[i] = self._pool[i], block
                self.blocks_yielded += 1
                yield torch.from_numpy(out)
            self._rng.shuffle(self._pool)  # finite stream: drain the buffer
            while self._pool:
                self.blocks_yielded += 1
                yield torch.from_numpy(self._pool.pop())
        finally:
            self._iterating = False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to continue with the next block (numpy arrays and plain Python)."""
        return {
            "documents": copy.deepcopy(self.documents.state_dict()),
            "carry": self._carry.copy(),
            "pool": np.stack(self._pool) if self._pool else np.zeros((0, self.seq_len), dtype=np.int64),
            "rng": self._rng.getstate(),
            "epoch": self.epoch,
            "blocks_yielded": self.blocks_yielded,
            "seq_len": self.seq_len,
            "bos_id": self.bos_id,
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["seq_len"]) != self.seq_len or state.get("bos_id") != self.bos_id:
            raise DataError(f"data state was saved with seq_len {state['seq_len']} and BOS {state.get('bos_id')}, "
                            f"this run uses {self.seq_len} and {self.bos_id}")
        self._doc_state = copy.deepcopy(state["documents"])
        self._carry = np.asarray(state["carry"], dtype=np.int64).copy()
        self._pool = [np.asarray(row, dtype=np.int64).copy() for row in state["pool"]]
        self._rng.setstate(state["rng"])
        self.epoch = int(state["epoch"])
        self.blocks_yielded = int(state["blocks_yielded"])


def eval_blocks(
    documents: Any,
    tokenize: Callable[[str], list[int]],
    *,
    seq_len: int,
    eos_id: int,
    max_sequences: int,
    spread: bool,
    bos_id: int | None = None,
    text_field: str = "text",
) -> list[torch.Tensor]:
    """Held-out blocks: all blocks of a finite source evenly sub-sampled to ``max_sequences``
    (``spread``, local files), or the first ``max_sequences`` of an endless stream."""
    docs = (tokenize(d[text_field]) for d in documents)
    blocks: list[np.ndarray] = []
    for block in pack_tokens(docs, seq_len, eos_id, bos_id):
        blocks.append(block)
        if not spread and len(blocks) >= max_sequences:
            break
    if spread and len(blocks) > max_sequences > 0:
        idx = np.linspace(0, len(blocks) - 1, max_sequences).round().astype(int)
        blocks = [blocks[i] for i in idx]
    return [torch.from_numpy(b.copy()) for b in blocks[:max_sequences]]
