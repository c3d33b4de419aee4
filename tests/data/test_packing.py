"""Packing: every token of every document lands in exactly one block of one rank; resumable state."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from retrofit.data.packing import PackedSequences, eval_blocks, make_tokenize, pack_tokens, sequence_bos
from retrofit.data.sources import load_documents, shard_documents
from retrofit.errors import DataError

EOS = 0


def _tokenize(text: str) -> list[int]:
    return [int(t) for t in text.split()]


def _write_docs(folder, n_files=3, docs_per_file=9, seed=0):
    """jsonl files of documents whose tokens are globally unique ids (so any loss or repeat shows)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    docs, next_id = [], 1
    for f in range(n_files):
        lines = []
        for _ in range(docs_per_file):
            n = int(rng.integers(1, 40))
            ids = list(range(next_id, next_id + n))
            next_id += n
            docs.append(ids)
            lines.append(json.dumps({"text": " ".join(map(str, ids))}))
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return sorted(folder.glob("*.jsonl")), docs


def _rank_stream(files, rank, world, seq_len, shuffle=0, repeat=False, seed=0, bos=None):
    docs = shard_documents(load_documents(files=files), rank, world)
    tokenize = _tokenize if bos is None else (lambda text: [bos] + _tokenize(text))
    return PackedSequences(docs, tokenize, seq_len=seq_len, eos_id=EOS, bos_id=bos, shuffle_buffer=shuffle, seed=seed,
                           repeat=repeat)


@pytest.mark.parametrize("world,n_files", [(1, 3), (2, 3), (3, 3)])
def test_no_token_lost_or_duplicated_across_blocks_and_ranks(tmp_path, world, n_files):
    files, docs = _write_docs(tmp_path, n_files=n_files)
    seq_len = 7
    seen = Counter()
    for rank in range(world):
        ps = _rank_stream(files, rank, world, seq_len)
        blocks = [b.numpy() for b in ps]
        assert all(b.shape == (seq_len,) for b in blocks)
        stream = np.concatenate(blocks + [ps.state_dict()["carry"]])  # blocks + the unfinished tail
        # the rank's stream is its documents in order, each followed by one EOS
        pieces = np.split(stream, np.flatnonzero(stream == EOS) + 1)
        rank_docs = [p[:-1].tolist() for p in pieces if len(p)]
        assert all(p[-1] == EOS for p in pieces if len(p))
        seen.update(t for d in rank_docs for t in d)
        assert len(ps.state_dict()["carry"]) < seq_len
    everything = [t for d in docs for t in d]
    assert sorted(seen) == sorted(everything)  # each token exactly once over all ranks
    assert max(seen.values()) == 1


BOS = 10**6


def test_every_block_starts_with_bos_and_content_is_kept_once_in_order(tmp_path):
    files, docs = _write_docs(tmp_path)
    bos_tokenize = lambda text: [BOS] + _tokenize(text)  # a tokenizer that adds BOS, like Gemma's
    for seq_len in (2, 5, 8):
        ps = PackedSequences(load_documents(files=files), bos_tokenize, seq_len=seq_len, eos_id=EOS, bos_id=BOS,
                             repeat=False)
        blocks = [b.tolist() for b in ps]
        assert all(len(b) == seq_len and b[0] == BOS for b in blocks)
        assert not any(b[1] == BOS for b in blocks)  # a document's own BOS is never doubled
        flat = [t for b in blocks for t in b] + ps.state_dict()["carry"].tolist()
        content = [t for t in flat if t != BOS]
        assert content == [t for d in docs for t in d + [EOS]]  # every token once, in order
        # each document still starts right after a BOS
        starts = [i for i, t in enumerate(flat) if t in {d[0] for d in docs}]
        assert all(flat[i - 1] == BOS for i in starts)


def test_shuffle_buffer_permutes_blocks_only(tmp_path):
    files, _ = _write_docs(tmp_path)
    plain = [tuple(b.tolist()) for b in _rank_stream(files, 0, 1, 5)]
    mixed = [tuple(b.tolist()) for b in _rank_stream(files, 0, 1, 5, shuffle=6, seed=3)]
    assert Counter(plain) == Counter(mixed)
    assert plain != mixed


@pytest.mark.parametrize("bos", [None, 10**6])
def test_resume_continues_with_the_very_next_block_across_epochs(tmp_path, bos):
    files, docs = _write_docs(tmp_path, n_files=2, docs_per_file=4)
    total_tokens = sum(len(d) + 1 for d in docs)
    n = 3 * total_tokens // 6  # three passes over the data (repeat=True) at seq_len 6

    def take(ps, k):
        it = iter(ps)
        return [next(it) for _ in range(k)]

    ref = take(_rank_stream(files, 0, 1, 6, shuffle=5, repeat=True, seed=1, bos=bos), n)
    for cut in (1, n // 3, n // 2 + 1):  # mid-document, near an epoch boundary, in the next epoch
        first = _rank_stream(files, 0, 1, 6, shuffle=5, repeat=True, seed=1, bos=bos)
        head = take(first, cut)
        state = first.state_dict()
        second = _rank_stream(files, 0, 1, 6, shuffle=5, repeat=True, seed=1, bos=bos)
        second.load_state_dict(state)
        tail = take(second, n - cut)
        assert all(torch.equal(a, b) for a, b in zip(ref, head + tail))
    assert second.epoch >= 2


def test_real_tokenizer_adds_bos_and_eos_between_documents(tmp_path):
    from tests.train import tiny

    tok = tiny.tokenizer()
    (tmp_path / "a.txt").write_text("Call me Ishmael.")
    (tmp_path / "b.txt").write_text("It is a truth universally acknowledged.")
    docs = load_documents(files=sorted(tmp_path.glob("*.txt")))
    assert sequence_bos(tok) == tok.bos_token_id
    blocks = list(PackedSequences(docs, make_tokenize(tok), seq_len=4, eos_id=tok.eos_token_id, repeat=False))
    stream = torch.cat(blocks).tolist()
    first = tok("Call me Ishmael.")["input_ids"]
    assert first[0] == tok.bos_token_id
    assert stream[: len(first) + 1] == first + [tok.eos_token_id]
    assert stream[len(first) + 1] == tok.bos_token_id  # the second document starts right after the EOS


def test_missing_text_field_and_empty_rank_are_clear_errors(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"content": "1 2 3"}) + "\n")
    ps = PackedSequences(load_documents(files=[tmp_path / "x.jsonl"]), _tokenize, seq_len=2, eos_id=EOS)
    with pytest.raises(DataError, match="no 'text' field.*content"):
        next(iter(ps))
    (tmp_path / "y.jsonl").write_text(json.dumps({"text": "1 2 3"}) + "\n")
    lonely = shard_documents(load_documents(files=[tmp_path / "y.jsonl"]), rank=1, world_size=2)
    with pytest.raises(DataError, match="holds no document"):
        next(iter(PackedSequences(lonely, _tokenize, seq_len=2, eos_id=EOS)))


def test_eval_blocks_spread_over_the_whole_source():
    docs = [{"text": " ".join(str(i) for i in range(1, 101))}]
    blocks = eval_blocks(docs, _tokenize, seq_len=10, eos_id=EOS, max_sequences=3, spread=True)
    assert [b[0].item() for b in blocks] == [1, 41, 91]  # first, middle, last of the ten blocks
    first = eval_blocks(iter(docs), _tokenize, seq_len=10, eos_id=EOS, max_sequences=3, spread=False)
    assert [b[0].item() for b in first] == [1, 11, 21]
    assert [b.tolist() for b in pack_tokens(iter([[1, 2, 3]]), 2, EOS)] == [[1, 2], [3, EOS]]
    assert [b.tolist() for b in pack_tokens(iter([[9, 1, 2, 3]]), 3, EOS, bos_id=9)] == [[9, 1, 2], [9, 3, EOS]]
