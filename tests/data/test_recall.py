"""Long-range recall snippets in training sequences: lengths and BOS kept, facts before their answers
by min_distance, a pure function of (seed, index), never the passkey wording; the training stream
applies them by global sequence index, through a resume and across ranks."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from retrofit.data.packing import make_tokenize
from retrofit.data.recall import (COLOURS, CUE_TOKENS, FORBIDDEN, NAMES, PLACES, TEMPLATES, THINGS, WORDS,
                                  RecallConfig, RecallInserter)
from retrofit.errors import SpecError
from tests.train import tiny

SEQ = 1024


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


@pytest.fixture(scope="module")
def book(tok):
    ids = tok(tiny.book_text(chars=12_000))["input_ids"]
    assert len(ids) >= SEQ
    return np.asarray(ids[:SEQ], dtype=np.int64)


def _inserter(tok, **kw) -> RecallInserter:
    return RecallInserter(RecallConfig(**{"share": 1.0, "facts": 4, "min_distance": 300, **kw}), make_tokenize(tok, special_tokens=False))


@pytest.mark.parametrize("style", ["facts", "repeats", "mixed"])
def test_length_dtype_and_first_token_are_kept_and_only_snippets_change(tok, book, style):
    ins = _inserter(tok, style=style)
    for index in range(40):
        out = ins(book, index)
        assert out.shape == book.shape and out.dtype == book.dtype and out[0] == book[0]
        changed = np.flatnonzero(out != book)
        spans = [(p.fact_start, p.fact_stop) for p in ins.plan(SEQ, index)] + \
                [(p.qa_start, p.qa_stop) for p in ins.plan(SEQ, index)]
        assert all(any(a <= i < b for a, b in spans) for i in changed)
    assert book[0] == tok.bos_token_id  # the input is not modified in place


def test_facts_precede_their_answers_by_min_distance_and_never_overlap(tok, book):
    ins = _inserter(tok, facts=5, min_distance=400)
    for index in range(60):
        out, plan = ins(book, index), ins.plan(SEQ, index)
        assert len(plan) == 5
        spans = sorted([(p.fact_start, p.fact_stop) for p in plan] + [(p.qa_start, p.qa_stop) for p in plan])
        assert spans[0][0] >= 1 and spans[-1][1] <= SEQ
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        for p in plan:
            n = len(p.value_ids)
            assert out[p.fact_value:p.fact_value + n].tolist() == list(p.value_ids)
            assert out[p.answer_value:p.answer_value + n].tolist() == list(p.value_ids)
            assert p.fact_start <= p.fact_value and p.fact_value + n <= p.fact_stop
            assert p.qa_start < p.answer_value and p.answer_value + n <= p.qa_stop
            assert p.answer_value - p.fact_stop >= 400
            value = tok.decode(list(p.value_ids)).strip()
            assert value in tok.decode(out[p.fact_start:p.fact_stop].tolist())
            question, answer = tok.decode(out[p.qa_start:p.qa_stop].tolist()).split("?", 1)
            assert value in answer and value not in question


def test_a_repeat_is_the_texts_own_cue_then_a_value_written_again_beyond_min_distance(tok, book):
    ins = _inserter(tok, facts=5, min_distance=400, style="repeats")
    values = set()
    for index in range(60):
        out, plan = ins(book, index), ins.plan(SEQ, index)
        assert len(plan) == 5
        spans = sorted([(p.fact_start, p.fact_stop) for p in plan] + [(p.qa_start, p.qa_stop) for p in plan])
        assert spans[0][0] >= 1 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        for p in plan:
            n, cue = len(p.value_ids), p.fact_value - p.fact_start
            assert CUE_TOKENS[0] <= cue <= CUE_TOKENS[1] and p.fact_stop == p.fact_value + n
            assert out[p.fact_start:p.fact_value].tolist() == book[p.fact_start:p.fact_value].tolist()  # left as is
            assert out[p.fact_value:p.fact_stop].tolist() == list(p.value_ids)
            # the answer is the same cue, then the same value, and nothing else
            assert out[p.qa_start:p.qa_stop].tolist() == out[p.fact_start:p.fact_stop].tolist()
            assert p.answer_value == p.qa_start + cue and p.answer_value - p.fact_stop >= 400
            values.add(tok.decode(list(p.value_ids)).strip())
    assert any(v.isdigit() for v in values) and any(v in WORDS for v in values)
    assert all(v.isdigit() or v in WORDS for v in values)  # the only words a repeat adds: values


def test_mixed_draws_both_forms(tok, book):
    mixed = _inserter(tok, facts=6, style="mixed")
    forms = [out[p.qa_start:p.qa_stop].tolist() == out[p.fact_start:p.fact_stop].tolist()
             for index in range(40) for out in [mixed(book, index)] for p in mixed.plan(SEQ, index)]
    assert 0.3 < np.mean(forms) < 0.7


def test_template_facts_are_the_sequences_they_were_before_styles_existed():
    """Runs written before ``style`` resume on exactly their data: the digest below is of the facts the
    inserter wrote before the option (the same seed, sequences and a byte-level encoder, so no tokenizer
    version enters), and ``style="facts"`` must draw the same."""
    import hashlib

    ids = np.arange(3000, dtype=np.int64) % 251 + 300
    ins = RecallInserter(RecallConfig(share=0.7, facts=5, min_distance=900, seed=3, style="facts"),
                         lambda text: list(text.encode()))
    digest = hashlib.sha256()
    for index in range(50):
        digest.update(ins(ids, index).tobytes())
    assert digest.hexdigest()[:16] == "11cbfff94e8878c2"


def test_a_sequence_is_a_pure_function_of_seed_and_index(tok, book):
    a, b = _inserter(tok, seed=7), _inserter(tok, seed=7)
    for index in (0, 1, 999, 123_456_789):
        assert np.array_equal(a(book, index), b(book, index))
    assert not np.array_equal(a(book, 0), a(book, 1))
    assert not np.array_equal(a(book, 0), _inserter(tok, seed=8)(book, 0))
    assert np.array_equal(a(book, 5), a(book, 5))  # no state carried between calls


def test_share_zero_keeps_every_sequence_and_share_one_rewrites_every_one_that_fits(tok, book):
    off = _inserter(tok, share=0.0)
    assert all(off(book, i) is book for i in range(200))
    on = _inserter(tok, share=1.0)
    assert all(not np.array_equal(on(book, i), book) for i in range(200))
    short = book[:350]  # 300 tokens apart plus the snippets do not fit
    assert all(on(short, i) is short for i in range(50))
    half = _inserter(tok, share=0.5)
    rewritten = sum(half.plan(SEQ, i) is not None for i in range(600))
    assert 240 < rewritten < 360


def test_no_passkey_wording_in_the_word_lists_or_in_generated_snippets(tok, book):
    library = [s for t in TEMPLATES for s in t] + list(NAMES + THINGS + PLACES + WORDS + COLOURS)
    assert not [(s, f) for s in library for f in FORBIDDEN if f in s.lower()]
    assert not [s for s in library if "pass" in s.lower() or "key" in s.lower() or "remember" in s.lower()]
    assert not set(WORDS + COLOURS) & set(THINGS + PLACES)  # a value never names its own key
    ins = _inserter(tok, facts=6)
    texts = []
    for index in range(200):
        out = ins(book, index)
        for p in ins.plan(SEQ, index):
            texts += [tok.decode(out[p.fact_start:p.fact_stop].tolist()), tok.decode(out[p.qa_start:p.qa_stop].tolist())]
    joined = " ".join(texts).lower()
    assert not [f for f in FORBIDDEN if f in joined]
    stems = [re.compile(re.escape(t[2]).replace(r"\{", "{").replace(r"\}", "}").replace("{name}", ".+?")
                        .replace("{thing}", ".+?").replace("{place}", ".+?")) for t in TEMPLATES]
    assert sum(any(s.search(t) for t in texts) for s in stems) == len(TEMPLATES) >= 5  # every phrasing is used


@pytest.mark.parametrize("bad,message", [({"share": 1.5}, "recall.share"), ({"facts": 0}, "recall.facts"),
                                         ({"min_distance": 0}, "recall.min_distance"), ({"seed": -1}, "recall.seed"),
                                         ({"answer_weight": 0.0}, "recall.answer_weight"),
                                         ({"answer_weight": float("inf")}, "recall.answer_weight"),
                                         ({"style": "passkey"}, "recall.style")])
def test_out_of_range_config_is_a_spec_error(bad, message):
    with pytest.raises(SpecError, match=message):
        RecallConfig(**bad).check()


# ----------------------------------------------------------------------------- the training stream
def _recipe(tmp_path, **recall):
    from retrofit.train.recipe import recipe_from_dict

    books = tiny.write_books(tmp_path / "books", n=4, chars=6_000)
    d = tiny.recipe_dict(tmp_path / "model", books, tmp_path / "out",
                         data={"seq_len": 512, "shuffle_buffer": 4, **({"recall": recall} if recall else {})})
    if recall.get("answer_weight", 1.0) != 1.0:  # weighs the attention term
        d["train"]["objective"] = "attention"
    return recipe_from_dict(d, base_dir=tmp_path)


def _take(stream, n):
    return [t.clone() for t in itertools.islice(iter(stream), n)]


def test_training_stream_rewrites_by_global_index_and_resumes_exactly(tmp_path, tok):
    from retrofit.train.data import RecallSequences, data_files, train_stream

    recall = {"share": 0.5, "facts": 3, "min_distance": 200, "seed": 3}
    recipe, plain_recipe = _recipe(tmp_path, **recall), _recipe(tmp_path)
    files = data_files(recipe)
    ins = RecallInserter(RecallConfig(**recall), make_tokenize(tok, special_tokens=False))
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        stream, desc = train_stream(recipe, tok, files, rank, world)
        assert isinstance(stream, RecallSequences) and "recall" in desc
        plain = _take(train_stream(plain_recipe, tok, files, rank, world)[0], 12)
        ref = _take(stream, 12)
        expected = [torch.from_numpy(ins(p.numpy(), i * world + rank)) for i, p in enumerate(plain)]
        assert all(torch.equal(a, b) for a, b in zip(ref, expected))
        assert sum(not torch.equal(a, b) for a, b in zip(ref, plain)) >= 2  # some were rewritten ...
        assert all(a.shape == b.shape and a[0] == b[0] for a, b in zip(ref, plain))
        for cut in (1, 5):  # ... and a resumed stream rewrites exactly the same ones
            first = train_stream(recipe, tok, files, rank, world)[0]
            it = iter(first)
            head = [next(it).clone() for _ in range(cut)]
            state = first.state_dict()
            second = train_stream(recipe, tok, files, rank, world)[0]
            second.load_state_dict(state)
            tail = _take(second, 12 - cut)
            assert all(torch.equal(a, b) for a, b in zip(ref, head + tail))


def test_recall_off_is_the_plain_stream_and_eval_is_never_rewritten(tmp_path, tok):
    from retrofit.data.packing import PackedSequences
    from retrofit.train.data import data_files, heldout_sequences, train_stream
    from retrofit.train.loop import _fingerprint

    off, on = _recipe(tmp_path), _recipe(tmp_path, share=1.0, facts=2, min_distance=100)
    assert isinstance(train_stream(off, tok, data_files(off), 0, 1)[0], PackedSequences)
    off.data.holdout_last = on.data.holdout_last = 1
    ev_off, _ = heldout_sequences(off, tok, data_files(off))
    ev_on, _ = heldout_sequences(on, tok, data_files(on))
    assert ev_off and all(torch.equal(a, b) for a, b in zip(ev_off, ev_on))
    assert _fingerprint(off)["hash"] != _fingerprint(on)["hash"]
    assert "recall" not in _fingerprint(off)["data"]  # recall off: checkpoints written before it still resume
    assert "answer_weight" not in _fingerprint(on)["data"]["recall"]  # unweighted: the hash from before the key
    assert "style" not in _fingerprint(on)["data"]["recall"]  # template facts: the hash from before the key
    repeats = _recipe(tmp_path, share=1.0, facts=2, min_distance=100, style="repeats")
    assert _fingerprint(repeats)["hash"] != _fingerprint(on)["hash"]
    weighted = _recipe(tmp_path, share=1.0, facts=2, min_distance=100, answer_weight=5.0)
    before = _fingerprint(weighted)["hash"]
    weighted.data.recall.answer_weight = 1.0  # the same recipe, unweighted: a run of one cannot resume the other
    assert _fingerprint(weighted)["hash"] != before


@pytest.mark.parametrize("style", ["facts", "repeats"])
def test_position_weights_mark_exactly_the_positions_that_predict_an_answers_value(tok, book, style):
    ins = _inserter(tok, facts=3, min_distance=300, answer_weight=25.0, style=style)
    for index in range(20):
        out, plan, w = ins(book, index), ins.plan(SEQ, index), ins.position_weights(SEQ, index)
        assert w.shape == (SEQ,) and w.dtype == np.float32
        marked = np.flatnonzero(w != 1.0)
        assert set(w[marked].tolist()) == {25.0}
        # each marked position's next token is a value token of an answer, and every answer value token is covered
        expected = sorted(p.answer_value - 1 + j for p in plan for j in range(len(p.value_ids)))
        assert marked.tolist() == expected
        assert np.flatnonzero(ins.answer_mask(SEQ, index)).tolist() == expected
        for p in plan:
            assert out[p.answer_value:p.answer_value + len(p.value_ids)].tolist() == list(p.value_ids)
            assert p.answer_value - 1 >= p.fact_stop + 300 - 1  # read beyond min_distance
    none = _inserter(tok, share=0.0, answer_weight=25.0)
    assert np.array_equal(none.position_weights(SEQ, 0), np.ones(SEQ, dtype=np.float32))


def test_a_marked_stream_yields_the_same_ids_with_their_answer_positions(tmp_path, tok):
    from retrofit.train.data import train_stream, data_files

    recall = {"share": 0.5, "facts": 3, "min_distance": 200, "seed": 3}
    plain, weighted = _recipe(tmp_path, **recall), _recipe(tmp_path, **recall, answer_weight=8.0)
    ins = RecallInserter(RecallConfig(**recall, answer_weight=8.0), make_tokenize(tok, special_tokens=False))
    for rank, world in ((0, 1), (1, 2)):
        ref = _take(train_stream(plain, tok, data_files(plain), rank, world)[0], 6)
        stream, desc = train_stream(weighted, tok, data_files(weighted), rank, world)
        assert "weighted x8 in the attention term" in desc
        items = list(itertools.islice(iter(stream), 6))
        assert all(isinstance(item, tuple) and len(item) == 2 for item in items)
        assert all(torch.equal(ids, r) for (ids, _), r in zip(items, ref))
        for i, (ids, mask) in enumerate(items):
            assert mask.dtype == torch.bool and mask.shape == ids.shape
            assert np.array_equal(mask.numpy(), ins.answer_mask(len(ids), i * world + rank))
            assert np.array_equal(ins.position_weights(len(ids), i * world + rank), np.where(mask.numpy(), 8.0, 1.0))
        assert any(bool(mask.any()) for _, mask in items)
    # the recall term reads the same marks; an objective that reads neither gets plain ids
    term = _recipe(tmp_path, **recall)
    term.train.objective = "recall"
    items = list(itertools.islice(iter(train_stream(term, tok, data_files(term), 0, 1)[0]), 3))
    assert all(isinstance(item, tuple) for item in items)
    assert all(isinstance(item, torch.Tensor) for item in itertools.islice(iter(train_stream(plain, tok, data_files(plain), 0, 1)[0]), 3))
