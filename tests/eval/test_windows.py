"""Token windows: exact lengths, BOS handling, non-overlap, round-robin caps, packing."""
from __future__ import annotations

import pytest

from retrofit.errors import DataError
from retrofit.eval.corpora import Document
from retrofit.eval.windows import build_windows, encode, encode_prefix

TEXT = "The angler walked along the river bank at dawn, watching the water. " * 60


def _docs():
    return [Document("long", TEXT), Document("short", "too short"), Document("mid", TEXT[: len(TEXT) // 2])]


def test_doc_windows_exact_length_bos_and_contiguous(tokenizer):
    bos = tokenizer.bos_token_id
    wins = build_windows(_docs(), tokenizer, [32, 64], protocol="windows", bos_id=bos)
    ids_long = encode(tokenizer, TEXT)
    for L, ws in wins.items():
        assert ws, L
        for w in ws:
            assert w.input_ids.numel() == L and int(w.input_ids[0]) == bos
            assert w.doc_id in ("long", "mid")
        long_wins = [w for w in ws if w.doc_id == "long"]
        assert [w.start for w in long_wins] == [i * (L - 1) for i in range(len(ids_long) // (L - 1))]
        for w in long_wins:  # body tokens are the document's own tokens, windows do not overlap
            assert w.input_ids[1:].tolist() == ids_long[w.start : w.start + L - 1]


def test_without_bos_windows_are_pure_text(tokenizer):
    wins = build_windows([Document("d", TEXT)], tokenizer, [40], protocol="windows", bos_id=None)
    ids = encode(tokenizer, TEXT)
    assert wins[40][0].input_ids.tolist() == ids[:40]
    assert wins[40][1].start == 40


def test_cap_is_round_robin_over_documents(tokenizer):
    wins = build_windows(_docs(), tokenizer, [32], protocol="windows", max_windows=3, bos_id=1)[32]
    assert [(w.doc_id, w.start) for w in wins] == [("long", 0), ("mid", 0), ("long", 31)]


def test_packed_stream_has_separators(tokenizer):
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    docs = [Document("a", "first document here."), Document("b", "second one."), Document("c", TEXT)]
    wins = build_windows(docs, tokenizer, [16], protocol="packed", bos_id=bos, eos_id=eos, max_windows=4)[16]
    assert len(wins) == 4 and all(w.input_ids.numel() == 16 for w in wins)
    body = [t for w in wins for t in w.input_ids[1:].tolist()]
    expected = encode(tokenizer, "first document here.") + [eos, bos] + encode(tokenizer, "second one.") + [eos, bos]
    assert body[: len(expected)] == expected
    assert [w.doc_id for w in wins][:1] == ["a"] and wins[-1].doc_id == "c"


def test_encode_prefix_matches_full_encoding_on_its_prefix(tokenizer):
    text = ("A paragraph of text that goes on for a while.\n\n" * 400)
    full = encode_prefix(tokenizer, text, None, chunk_chars=2000)
    capped = encode_prefix(tokenizer, text, 100, chunk_chars=2000)
    assert len(capped) >= 100 and full[: len(capped)] == capped
    assert len(full) > len(capped)


def test_bad_lengths_and_protocol(tokenizer):
    with pytest.raises(DataError):
        build_windows(_docs(), tokenizer, [2], protocol="windows", bos_id=1)
    with pytest.raises(DataError):
        build_windows(_docs(), tokenizer, [32], protocol="nope")
