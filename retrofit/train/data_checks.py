"""Checks on a recipe's data before step 1: decodable text, enough tokens, positions the model has.

Each failure is one :class:`~retrofit.errors.DataError` saying what to change; none of them
silently trains on garbage (a corpus repeated inside every sequence, empty documents packed
into BOS/EOS pairs, positions the model never saw, text with replacement characters).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from retrofit.data.sources import LOCAL_FORMATS, load_documents, shard_documents
from retrofit.data.text import check_utf8
from retrofit.errors import DataError
from retrofit.train.recipe import Recipe

__all__ = ["check_decodable", "check_heldout", "check_json_lines", "check_positions", "check_enough_tokens"]

_TEXT_SUFFIXES = tuple(s for s, fmt in LOCAL_FORMATS.items() if fmt in ("text", "json"))


def check_decodable(recipe: Recipe, files: Any) -> None:
    """Under ``data.text_errors=strict``, every local txt/jsonl file must be valid UTF-8 (error: file + byte
    offset); every line of a .jsonl file must be a JSON object (error: file + line), whatever the policy."""
    local = [*(files.train or []), *files.held_out]
    if recipe.data.text_errors == "strict":
        for f in local:
            if f.suffix.lower() in _TEXT_SUFFIXES:
                check_utf8(f, option="data.text_errors=replace")
    for f in local:
        if f.suffix.lower() == ".jsonl":
            check_json_lines(f, errors=recipe.data.text_errors)


def check_heldout(recipe: Recipe, files: Any) -> None:
    """Held-out files that hold no text (empty, blank, or .jsonl without a line) would train with no
    held-out loss and no word about it: an error naming them, unless ``eval.sequences=0`` asks for none."""
    if not files.held_out or recipe.eval.sequences == 0:
        return
    empty = [f for f in files.held_out if _blank(f)]
    if len(empty) == len(files.held_out):
        names = ", ".join(str(f) for f in empty[:4]) + (", ..." if len(empty) > 4 else "")
        raise DataError(f"the held-out (eval) files hold no text: {names}; fill them, point eval.files at "
                        "other files, or set eval.sequences=0 to train without a held-out loss")


def _blank(path: Path, limit: int = 1 << 20) -> bool:
    """Whether a local file surely holds no document: 0 bytes, or (txt/jsonl up to ``limit`` bytes) only blanks."""
    size = path.stat().st_size
    if size == 0:
        return True
    if size > limit or path.suffix.lower() not in _TEXT_SUFFIXES:
        return False
    return not path.read_bytes().strip()


def check_json_lines(path: Path, errors: str = "strict") -> None:
    """Every non-blank line of the JSON Lines file ``path`` is a JSON object, else one DataError naming the line."""
    with open(path, encoding="utf-8", errors=errors) as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}: line {number} is not valid JSON ({str(exc).splitlines()[0]}); fix or "
                                "delete that line") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}: line {number} is a JSON {type(record).__name__}, not an object with the "
                                "text field; fix or delete that line")


def check_positions(recipe: Recipe, config: Any) -> None:
    """``data.seq_len`` within the model's ``max_position_embeddings`` unless ``data.allow_long_positions``."""
    max_pos = getattr(config, "max_position_embeddings", None)
    seq_len = recipe.data.seq_len
    if max_pos is None or seq_len <= int(max_pos) or recipe.data.allow_long_positions:
        return
    raise DataError(f"data.seq_len={seq_len} exceeds the model's max_position_embeddings={max_pos}: lower "
                    f"data.seq_len to {max_pos} or less, or set data.allow_long_positions=true to train on positions "
                    "the model was not pretrained on (length extrapolation)")


def check_enough_tokens(recipe: Recipe, tokenize: Any, files: Any, rank: int, world: int) -> int:
    """This rank's local training documents must hold at least one step's tokens (``batch_size / world x seq_len``).

    Counts the tokens of non-blank documents (plus their EOS) and stops as soon as there are enough,
    so the cost is one step's worth of tokenisation. A streamed hub dataset is not checked. Returns
    the tokens counted.
    """
    if files.train is None:
        return -1
    d = recipe.data
    need = recipe.train.batch_size // max(world, 1) * d.seq_len
    docs = shard_documents(load_documents(files=files.train, text_field=d.text_field, errors=d.text_errors), rank, world)
    have = 0
    names = ", ".join(f.name for f in files.train[:4]) + (", ..." if len(files.train) > 4 else "")
    for doc in docs:
        text = doc.get(d.text_field) if isinstance(doc, dict) else None
        if not isinstance(text, str):  # not "0 tokens": the field is missing or holds no text
            fields = ", ".join(k for k, v in doc.items() if v is not None) if isinstance(doc, dict) else "none"
            what = f"no {d.text_field!r} field" if text is None else \
                f"{str(text)[:40]!r} ({type(text).__name__}), not text, in its {d.text_field!r} field"
            raise DataError(f"the training data ({names}): a document has {what} (its fields: {fields}); set "
                            "data.text_field to the field that holds the text")
        if text.strip():
            have += len(tokenize(text)) + 1
            if have >= need:
                return have
    who = f"rank {rank}'s share of " if world > 1 else ""
    raise DataError(f"{who}the training data ({names}) holds {have} tokens but one step needs {need} "
                    f"(train.batch_size x data.seq_len{' / ranks' if world > 1 else ''}): add text, or lower "
                    "data.seq_len or train.batch_size")
