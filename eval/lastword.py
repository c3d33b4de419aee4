"""A LAMBADA-style last-word task built from the held-out books, offline and deterministic.

LAMBADA (Paperno et al., 2016) asks a model for the last word of a narrative passage whose
word is guessable only from the whole passage. Here the passages are paragraphs of the
held-out Project Gutenberg books (``pg-books-heldout``: Jack Sheppard, The Complete Angler;
public domain), never used for training:

- the book's text (whitespace collapsed to single spaces) is cut into consecutive, non-overlapping
  passages of whole sentences: sentences are added until a passage holds ``min_words`` words
  (passages past ``max_words`` are dropped);
- a passage qualifies when its last word is made of letters only (closing punctuation and quotes
  dropped), is at least ``min_target_chars`` long and is not a function word (:data:`STOPWORDS`);
  with ``in_context`` it must also occur earlier in the passage (the passage then holds the
  evidence, as in most LAMBADA items; about 150 passages of these two books pass, so it is off by
  default);
- ``context`` is the passage up to the word, ``target`` the word: ``context + " " + target`` is
  the book's text verbatim (after whitespace collapsing), followed there by punctuation;
- each book's first ``fewshot_fraction`` of passages is the few-shot part (``train``), the rest
  the ``test`` part, so few-shot examples and test items come from disjoint text; items are
  drawn from each part with ``random.Random(seed)`` and kept in book order.

:func:`build_items` is pure (books in, rows out); :func:`heldout_books` reads the corpus.
"""
from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

CORPUS = "pg-books-heldout"
STOPWORDS = frozenset("""
about above after again against also among another around because been before being below
between both could does doing down during each either every from further have having here hers
herself himself into itself just more most much must myself neither never none nothing once only
other ought ours ourselves over same shall should some such than that their theirs them
themselves then there these they this those through thus till under until upon very were what
when where whether which while whom whose will with would your yours yourself yourselves
""".split())
_SENTENCE_END = re.compile(r"[.!?][\"')\]_]*$")
_LAST_WORD = re.compile(r"^(?P<context>.*\S)\s+(?P<target>[A-Za-z]+)[^A-Za-z0-9\s]*$")


@dataclass(frozen=True)
class Settings:
    """How items are chosen; every field is a ``dataset_kwargs`` key of the task YAMLs."""

    seed: int = 1234
    test_items: int = 500
    fewshot_items: int = 100
    fewshot_fraction: float = 0.2
    min_words: int = 60
    max_words: int = 200
    min_target_chars: int = 4
    in_context: bool = False


def collapse(text: str) -> str:
    """The text with every run of whitespace (line breaks included) turned into one space."""
    return " ".join(text.split())


def passages(text: str, min_words: int, max_words: int) -> list[str]:
    """Consecutive, non-overlapping runs of whole sentences of ``collapse(text)``, each of at
    least ``min_words`` words (the last, shorter run is dropped, as are runs past ``max_words``)."""
    out: list[str] = []
    current: list[str] = []
    for word in collapse(text).split(" "):
        if not word:
            continue
        current.append(word)
        if len(current) >= min_words and _SENTENCE_END.search(word):
            if len(current) <= max_words:
                out.append(" ".join(current))
            current = []
    return out


def split_last_word(passage: str, settings: Settings = Settings()) -> tuple[str, str] | None:
    """``(context, target)`` when the passage qualifies (see the module docstring), else None."""
    m = _LAST_WORD.match(passage)
    if m is None:
        return None
    context, target = m.group("context"), m.group("target")
    if len(target) < settings.min_target_chars or target.lower() in STOPWORDS:
        return None
    if settings.in_context and not re.search(rf"\b{re.escape(target)}\b", context, flags=re.IGNORECASE):
        return None
    return context, target


def build_items(books: Iterable[tuple[str, str]], settings: Settings = Settings()) -> dict[str, list[dict]]:
    """``[(book_id, text)]`` -> ``{"train": rows, "test": rows}``; a row has ``id``
    (book:passage), ``book``, ``passage`` (index in the book), ``context``, ``target`` and
    ``text`` (``context + " " + target``). Same books and settings, same rows."""
    pools: dict[str, list[dict]] = {"train": [], "test": []}
    for book_id, text in books:
        chunks = passages(text, settings.min_words, settings.max_words)
        cut = int(len(chunks) * settings.fewshot_fraction)
        for i, chunk in enumerate(chunks):
            found = split_last_word(chunk, settings)
            if found is None:
                continue
            context, target = found
            pools["train" if i < cut else "test"].append({
                "id": f"{book_id}:{i}", "book": book_id, "passage": i,
                "context": context, "target": target, "text": f"{context} {target}",
            })
    test_texts = {row["text"] for row in pools["test"]}
    pools["train"] = [row for row in pools["train"] if row["text"] not in test_texts]  # repeated text
    rng = random.Random(settings.seed)
    return {
        "train": _draw(pools["train"], settings.fewshot_items, rng),
        "test": _draw(pools["test"], settings.test_items, rng),
    }


def _draw(pool: list[dict], n: int, rng: random.Random) -> list[dict]:
    """``n`` rows of ``pool`` (all when it holds fewer), in the pool's order."""
    if n >= len(pool):
        return list(pool)
    keep = sorted(rng.sample(range(len(pool)), n))
    return [pool[i] for i in keep]


def heldout_books(corpus: str = CORPUS) -> list[tuple[str, str]]:
    """``[(doc_id, text)]`` of a corpus (default: the held-out books), Gutenberg headers stripped."""
    from retrofit.eval import corpora

    return [(doc.doc_id, doc.text) for doc in corpora.iter_documents(corpora.resolve_corpus(corpus))]


@lru_cache(maxsize=4)
def items_from_corpus(corpus: str = CORPUS, settings: Settings = Settings()) -> dict[str, list[dict]]:
    """:func:`build_items` over a corpus (cached: both task variants read the same rows)."""
    return build_items(heldout_books(corpus), settings)


def settings_from(kwargs: dict) -> Settings:
    """The :class:`Settings` fields among ``kwargs`` (lm-eval also passes the task's metadata)."""
    known = Settings.__dataclass_fields__
    return Settings(**{k: v for k, v in kwargs.items() if k in known})


def dataset(corpus: str = CORPUS, **kwargs) -> Any:
    """The task's ``datasets.DatasetDict`` (``train`` = few-shot part, ``test``), built from ``corpus``."""
    import datasets

    rows = items_from_corpus(corpus, settings_from(kwargs))
    return datasets.DatasetDict({split: datasets.Dataset.from_list(r) for split, r in rows.items()})


def first_word(answer: str) -> str:
    """The first run of letters of a generated answer (``' Newgate.'`` -> ``'Newgate'``), or ''."""
    m = re.search(r"[A-Za-z]+", answer)
    return m.group(0) if m else ""


def score_generation(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results``: 1.0 when the answer's first word is the target (case counts,
    as in the log-likelihood accuracy, which asks for the target's exact tokens)."""
    return {"exact_match": float(first_word(results[0]) == doc["target"])}
