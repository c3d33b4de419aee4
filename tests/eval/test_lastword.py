"""The last-word task from the held-out books: deterministic rows, targets that are the true last
words of their passages, few-shot examples disjoint from test items, and exact scores both ways
(log-likelihood accuracy and the first generated word) for models whose answers are known."""
from __future__ import annotations

import re

import pytest

from retrofit.eval import harness, lastword

from .lm_stubs import KnownLM

BOOK = """Chapter one.

The miller kept a grey horse in the yard behind the mill, and every morning before the sun was up he
led the horse down to the river to drink. The horse knew the path well.

"Good morning," said the boy to the miller, who stood by the water with the horse. "Is that your horse?"
It is mine.
"""


@pytest.fixture(scope="module")
def books():
    return lastword.heldout_books()


@pytest.fixture(scope="module")
def rows(books):
    return lastword.build_items(books)


def test_passages_and_last_words_on_a_known_text():
    settings = lastword.Settings(min_words=10, max_words=40, min_target_chars=4)
    chunks = lastword.passages(BOOK, 10, 40)
    assert chunks[0].startswith("Chapter one. The miller") and chunks[0].endswith("the river to drink.")
    assert all(re.search(r"[.!?][\"')\]_]*$", c) for c in chunks)
    assert lastword.split_last_word(chunks[0], settings) == (chunks[0][: -len(" drink.")], "drink")
    assert lastword.split_last_word('He said "it is my horse."', lastword.Settings()) == ('He said "it is my', "horse")
    assert lastword.split_last_word("They went over there.", lastword.Settings()) is None  # function word
    assert lastword.split_last_word("It was a grey cat.", lastword.Settings()) is None  # too short
    assert lastword.split_last_word("The boy's horse.", lastword.Settings(in_context=True)) is None
    assert lastword.split_last_word("The horse ate; so did the horse.", lastword.Settings(in_context=True))


def test_builds_deterministically(books, rows):
    assert lastword.build_items(books) == rows
    assert len(rows["test"]) == 500 and len(rows["train"]) == 100
    other = lastword.build_items(books, lastword.Settings(seed=7))
    assert [r["id"] for r in other["test"]] != [r["id"] for r in rows["test"]]
    ds = lastword.dataset(version=1.0)  # lm-eval passes the metadata too
    assert ds["test"].to_list() == rows["test"] and ds["train"].to_list() == rows["train"]


def test_every_target_is_the_true_last_word_of_its_passage(books, rows):
    text = {book: lastword.collapse(body) for book, body in books}
    chunks = {book: lastword.passages(body, 60, 200) for book, body in books}
    for row in rows["train"] + rows["test"]:
        assert row["text"] == f"{row['context']} {row['target']}"
        assert re.fullmatch(r"[A-Za-z]{4,}", row["target"]) and row["target"].lower() not in lastword.STOPWORDS
        chunk = chunks[row["book"]][row["passage"]]
        assert chunk.startswith(row["text"]) and re.fullmatch(r"[^A-Za-z0-9\s]+", chunk[len(row["text"]):])
        at = text[row["book"]].find(chunk)
        assert at >= 0, row["id"]  # verbatim in the book, a sentence end right after the word
        assert re.match(r"[^A-Za-z0-9\s]*[.!?]", text[row["book"]][at + len(row["text"]):])


def test_fewshot_examples_never_overlap_test_items(books, rows):
    train, test = rows["train"], rows["test"]
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    for book, body in books:  # the few-shot part is the start of each book, the test part the rest
        cut = int(len(lastword.passages(body, 60, 200)) * lastword.Settings().fewshot_fraction)
        assert all(r["passage"] < cut for r in train if r["book"] == book)
        assert all(r["passage"] >= cut for r in test if r["book"] == book)
    test_text = " | ".join(r["text"] for r in test)
    for r in train:
        assert r["text"] not in test_text
        assert not any(t["text"] in r["text"] for t in test)


def test_first_word_scoring():
    doc = {"target": "Newgate"}
    assert lastword.score_generation(doc, [" Newgate."]) == {"exact_match": 1.0}
    assert lastword.score_generation(doc, ['"Newgate," he said']) == {"exact_match": 1.0}
    assert lastword.score_generation(doc, [" newgate"]) == {"exact_match": 0.0}  # case counts
    assert lastword.score_generation(doc, [" Newgates"]) == {"exact_match": 0.0}
    assert lastword.score_generation(doc, [""]) == {"exact_match": 0.0}


def test_known_answers_score_exactly_both_ways(rows):
    """Right on even-numbered passages only: both scorings give exactly that share (2-shot)."""
    lm = KnownLM(word=lambda doc: doc["target"] if doc["passage"] % 2 == 0 else "Nothing")
    res = harness.evaluate_model(lm, ["retrofit_books"], num_fewshot=2, limit=40, bootstrap_iters=0)["results"]
    expected = sum(r["passage"] % 2 == 0 for r in rows["test"][:40]) / 40
    assert 0 < expected < 1
    assert res["retrofit_books_lastword"]["acc,none"] == expected
    assert res["retrofit_books_lastword_gen"]["exact_match,none"] == expected
    prompt = lm.prompts[0]
    shots = prompt.split("\n\n")
    assert len(shots) == 3 and prompt.endswith(rows["test"][0]["context"])
    train = {r["text"] for r in rows["train"]}
    assert all(shot in train for shot in shots[:2])  # few-shot examples: whole passages of the few-shot part
