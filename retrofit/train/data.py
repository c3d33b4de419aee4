"""A recipe's data: the training stream of one rank and the fixed held-out sequences.

Used by the training loop and by anything that must score a model on exactly the sequences a
run evaluates on (e.g. the base model in scripts/research/swa_share_ablation.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from retrofit.data.bos import sequence_bos
from retrofit.data.documents import strip_gutenberg
from retrofit.data.packing import PackedSequences, document_positions, eval_blocks, make_tokenize
from retrofit.data.recall import RecallInserter
from retrofit.data.sources import load_documents, resolve_files, shard_documents, split_holdout
from retrofit.train.objectives import objective_weights
from retrofit.train.recipe import Recipe, recall_config

__all__ = ["DataFiles", "data_files", "recipe_tokenize", "recipe_bos", "train_stream", "heldout_sequences",
           "RecallSequences", "batch_positions"]


@dataclass
class DataFiles:
    train: list[Path] | None  # None: the hub dataset is streamed
    held_out: list[Path]  # eval files (explicit eval.files, else the held-out training files)


def data_files(recipe: Recipe) -> DataFiles:
    """Resolve (and check) the local files; cheap, so a run can fail on a bad path before loading a model."""
    d = recipe.data
    train, held = None, []
    if d.files is not None:
        train, held = split_holdout(resolve_files(d.files, recipe.base_dir), d.holdout_last)
    if recipe.eval.files is not None:
        held = resolve_files(recipe.eval.files, recipe.base_dir)
    return DataFiles(train, held)


def recipe_tokenize(recipe: Recipe, tokenizer: Any) -> Callable[[str], list[int]]:
    """``text -> ids`` with the tokenizer's special tokens, after the recipe's text cleaning."""
    tokenize = make_tokenize(tokenizer)
    if not recipe.data.strip_gutenberg:
        return tokenize
    return lambda text: tokenize(strip_gutenberg(text))


def recipe_bos(recipe: Recipe, tokenizer: Any) -> int | None:
    """The token every packed sequence starts with (``data.bos_every_sequence`` and a BOS-using tokenizer)."""
    return sequence_bos(tokenizer) if recipe.data.bos_every_sequence else None


class RecallSequences:
    """A rank's :class:`PackedSequences` with ``data.recall`` snippets written into its ``(seq_len,)`` blocks.

    Block ``i`` of rank ``rank`` (of ``world``) is global sequence ``i * world + rank``; ``i`` is the
    packer's own count of yielded blocks, part of its resumable state, so a resumed run rewrites
    exactly the sequences an uninterrupted one does. State is the packer's, unchanged.

    With ``marks`` (the objective reads the answers: ``data.recall.answer_weight`` > 1 or the
    ``recall`` term) each item is ``(ids, mask)``: the block and its ``(seq_len,)`` bool answer
    positions (:meth:`~retrofit.data.recall.RecallInserter.answer_mask`); otherwise the block alone.

    ``rewritten`` says whether the item just yielded was rewritten: its facts and answers lie
    across the whole block, whatever documents it packs, so :func:`batch_positions` reads it as
    one document.
    """

    def __init__(self, packed: PackedSequences, inserter: RecallInserter, rank: int, world: int, marks: bool = False):
        self.packed, self.inserter, self.rank, self.world, self.marks = packed, inserter, rank, world, marks
        self.rewritten = False

    def __iter__(self) -> Iterator[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        for block in self.packed:
            index = (self.packed.blocks_yielded - 1) * self.world + self.rank
            plain = block.numpy()
            out = self.inserter(plain, index)
            self.rewritten = out is not plain
            ids = torch.from_numpy(out)
            if self.marks:
                yield ids, torch.from_numpy(self.inserter.answer_mask(len(ids), index))
            else:
                yield ids

    def state_dict(self) -> dict:
        return self.packed.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.packed.load_state_dict(state)


def batch_positions(ids: torch.Tensor, eos_id: int | None, whole: Sequence[bool] = ()) -> torch.Tensor | None:
    """Position ids of packed sequences ``ids`` ``(B, T)`` that restart at each document (after
    each EOS: ``data.document_boundaries``), rows flagged in ``whole`` read as one document (recall
    rewrites); None when no row has a boundary, so the model keeps its own positions, bit for bit."""
    if eos_id is None:
        return None
    positions = document_positions(ids, int(eos_id))
    for row, one in enumerate(whole):
        if one:
            positions[row] = torch.arange(ids.shape[1], device=ids.device)
    if bool((positions[:, 1:] != positions[:, :-1] + 1).any()):
        return positions
    return None


def train_stream(recipe: Recipe, tokenizer: Any, files: DataFiles, rank: int,
                 world: int) -> tuple[PackedSequences | RecallSequences, str]:
    """This rank's resumable stream of packed training sequences, and a one-line description."""
    d = recipe.data
    if files.train is not None:
        names = [f.name for f in files.train]
        desc = f"{len(names)} local files ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
        docs = load_documents(files=files.train, text_field=d.text_field, errors=d.text_errors)
    else:
        desc = f"{d.dataset} ({d.split}, streamed)"
        docs = load_documents(dataset=d.dataset, dataset_config=d.dataset_config, split=d.split, text_field=d.text_field)
    stream = PackedSequences(shard_documents(docs, rank, world), recipe_tokenize(recipe, tokenizer), seq_len=d.seq_len,
                             eos_id=tokenizer.eos_token_id, bos_id=recipe_bos(recipe, tokenizer),
                             shuffle_buffer=d.shuffle_buffer, seed=d.seed + rank,
                             text_field=d.text_field)
    recall = recall_config(recipe)
    if recall.share > 0:
        marks = recall.answer_weight != 1.0 or "recall" in objective_weights(recipe.train.objective,
                                                                             recipe.train.objective_weights)
        kind = {"facts": "facts", "repeats": "repeated cues", "mixed": "facts or repeated cues"}[recall.style]
        desc += (f"; recall {kind} in {recall.share:.0%} of the sequences ({recall.facts} each, answers "
                 f">= {recall.min_distance} tokens later"
                 + (f", weighted x{recall.answer_weight:g} in the attention term)" if recall.answer_weight != 1.0 else ")"))
        inserter = RecallInserter(recall, make_tokenize(tokenizer, special_tokens=False))
        return RecallSequences(stream, inserter, rank, world, marks=marks), desc
    return stream, desc


def heldout_sequences(recipe: Recipe, tokenizer: Any, files: DataFiles) -> tuple[list[torch.Tensor], str]:
    """The ``eval.sequences`` held-out sequences (the same on every rank and every run of the recipe)."""
    d, e = recipe.data, recipe.eval
    if e.sequences == 0:
        return [], "none"
    if files.held_out:
        desc, docs, spread = ", ".join(f.name for f in files.held_out), load_documents(files=files.held_out, text_field=d.text_field,
                                                                                 errors=d.text_errors), True
    elif files.train is None:
        desc = f"{d.dataset} ({e.split}, first {e.sequences} sequences)"
        docs, spread = load_documents(dataset=d.dataset, dataset_config=d.dataset_config, split=e.split,
                                      text_field=d.text_field), False
    else:
        return [], "none (no held-out files: set data.holdout_last or eval.files)"
    blocks = eval_blocks(docs, recipe_tokenize(recipe, tokenizer), seq_len=d.seq_len, eos_id=tokenizer.eos_token_id,
                         max_sequences=e.sequences, spread=spread, bos_id=recipe_bos(recipe, tokenizer),
                         text_field=d.text_field)
    return blocks, desc
