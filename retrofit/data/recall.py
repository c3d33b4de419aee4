"""Long-range recall content written into packed training sequences.

On books the full attention's mass beyond a 1024-token window is small, so attention transfer
never asks a converted layer's latent states to carry a specific fact far. :class:`RecallInserter`
rewrites a seeded share of the sequences: ``facts`` short fact snippets overwrite book tokens in
the first part of the sequence and, at least ``min_distance`` tokens after the last fact, one
question+answer snippet per fact (in shuffled order) overwrites tokens in the last part::

    [BOS] book .. \\nNote: the locker of Mr. Hale is number 48213.\\n .. book .. (>= min_distance) ..
          \\nWhich number is Mr. Hale's locker? It is 48213.\\n .. book

The sequence keeps its length and its first token; snippets never overlap. A value's tokens are
the same ids in its fact and in its answer (the value is tokenised once, as ``" " + value``).
Everything about a sequence (whether it is rewritten, the facts, their places) is a pure function
of ``(seed, index, length)``, so a resumed run and every data-parallel rank see exactly the data
an uninterrupted run sees. A sequence too short for the snippets plus ``min_distance`` is left
unchanged. The wording never uses the passkey evaluator's phrases (``FORBIDDEN``): passkey
accuracy must measure transfer, not a memorised template.

Eight question templates teach the latent states those templates: a model trained on them answers
held-out facts in their wording and nothing else. ``style="repeats"`` writes the content-free form
of the same skill (long-range induction): a short cue of the sequence's own text (3-10 tokens,
left where it is) is followed by an inserted value, and at least ``min_distance`` tokens later the
cue is written again, followed by the same value::

    .. book: he went up the stair and found 48213 the door was locked .. (>= min_distance) ..
    .. book .. went up the stair and found 48213 .. book

Nothing in a repeat is worded by this module except the value, so no template can be memorised;
``style="mixed"`` draws each snippet from either form with equal odds.

A handful of answer tokens are a sliver of a sequence's positions, so uniform attention transfer
spends almost none of its gradient on them. :meth:`RecallInserter.answer_mask` marks them; the
training stream then yields ``(ids, mask)``, and the objective weighs them up in the attention
term (``answer_weight``) or trains on them end to end (the ``recall`` term,
:mod:`retrofit.train.objectives`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from retrofit.errors import SpecError

__all__ = ["RecallConfig", "RecallFact", "RecallInserter", "FORBIDDEN", "TEMPLATES", "STYLES"]

FORBIDDEN = ("pass key", "passkey", "pass-key", "remember it")  # the passkey evaluator's wording

# (fact before the value, fact after it, question, answer before the value, answer after it, value kind)
TEMPLATES: tuple[tuple[str, str, str, str, str, str], ...] = (
    ("Note: the {thing} of {name} is number", ".", "Which number is {name}'s {thing}?", "It is", ".", "number"),
    ("{name} wrote down that the {thing} in {place} has the code", ".",
     "What code did {name} write down for the {thing} in {place}?", "The code is", ".", "number"),
    ("The ledger says {name} paid", "shillings for the {thing}.", "How many shillings did {name} pay for the {thing}?",
     "{name} paid", "shillings.", "number"),
    ("In {place}, the {thing} of {name} is kept in drawer", ".", "In which drawer is {name}'s {thing} kept?",
     "In drawer", ".", "number"),
    ("A letter from {place} said that the watchword of {name} is", ".", "What is the watchword of {name}?",
     "The watchword is", ".", "word"),
    ("{name}'s {thing} bears the mark of the", ".", "Which mark does {name}'s {thing} bear?", "The mark of the", ".",
     "word"),
    ("Mind this: {name} lodges in {place} at house number", ".", "At which house number does {name} lodge?",
     "At number", ".", "number"),
    ("The {thing} that {name} left in {place} was painted", ".", "What colour was the {thing} that {name} left?",
     "It was painted", ".", "word"),
)

NAMES = ("Mr. Hale", "Mrs. Dunmore", "Captain Reyes", "Miss Ashby", "Dr. Pruett", "Lady Fenwick", "Old Tobias",
         "Mr. Carraway", "Sister Agnes", "Colonel Brandt", "Mrs. Whitlow", "Mr. Okafor", "Widow Hargreave",
         "Professor Lindqvist", "Mr. Quill", "Miss Delacroix", "Uncle Ezra", "Mrs. Penhallow", "Sergeant Moss",
         "Mr. Abernathy", "Madame Roux", "Father Callahan", "Miss Tremaine", "Mr. Yarrow", "Judge Whitcombe",
         "Mrs. Oduya", "Mr. Finch", "Lord Ashcombe", "Nurse Bellamy", "Mr. Stroud", "Miss Ingleby", "Bosun Garrick")
THINGS = ("locker", "trunk", "strongbox", "ledger", "carriage", "cabin", "parcel", "lantern", "saddle", "rowboat",
          "umbrella", "writing desk", "clock", "violin case", "hatbox", "chest", "barrel", "sketchbook")
PLACES = ("Bristol", "the old mill", "Lisbon", "the harbour", "Canterbury", "the vicarage", "Dover", "the market",
          "Aberdeen", "the inn by the bridge", "Calcutta", "the north tower", "Bath", "the boarding house",
          "Valparaiso", "the customs office")
WORDS = ("amber", "heron", "juniper", "cobalt", "thistle", "walnut", "crimson", "falcon", "saffron",
         "marble", "willow", "copper", "raven", "indigo", "orchid", "granite", "sparrow", "ivory", "cedar",
         "scarlet", "badger", "olive", "silver", "magpie", "ochre", "hazel", "violet", "otter", "emerald")
STYLES = ("facts", "repeats", "mixed")  # template facts | cue-and-value repeats of the text itself | either
CUE_TOKENS = (3, 10)  # a repeat's cue: this many tokens of the sequence's own text (inclusive range)
KEEP = -1  # in a snippet: a fact's "keep the sequence's token here"; an answer's "the fact's token here"
COLOURS = ("crimson", "cobalt", "ochre", "ivory", "scarlet", "emerald", "amber", "violet", "olive", "silver")


@dataclass(frozen=True)
class RecallConfig:
    """``share``: probability a sequence is rewritten (0 = off); ``facts`` per rewritten sequence;
    ``min_distance``: tokens from the end of a fact to the start of its answer's value; ``seed``;
    ``answer_weight``: the weight, in the attention-transfer loss, of the positions that predict an
    answer's value tokens (every other position weighs 1; 1 = all alike; see :meth:`RecallInserter.position_weights`);
    ``style``: one of :data:`STYLES` (see the module docstring)."""
    share: float = 0.0
    facts: int = 4
    min_distance: int = 1024
    seed: int = 0
    answer_weight: float = 1.0
    style: str = "facts"

    def check(self, where: str = "recall") -> "RecallConfig":
        """SpecError naming ``where.<field>`` for a value out of range."""
        if not (isinstance(self.share, (int, float)) and math.isfinite(self.share) and 0.0 <= self.share <= 1.0):
            raise SpecError(f"{where}.share must be in [0, 1] (the share of training sequences rewritten; 0 = off), "
                            f"got {self.share}")
        if not (isinstance(self.facts, int) and 1 <= self.facts <= 64):
            raise SpecError(f"{where}.facts must be an integer in [1, 64] (facts per rewritten sequence), got {self.facts}")
        if not (isinstance(self.min_distance, int) and self.min_distance >= 1):
            raise SpecError(f"{where}.min_distance must be >= 1 (tokens between a fact and its answer), "
                            f"got {self.min_distance}")
        if not (isinstance(self.seed, int) and self.seed >= 0):
            raise SpecError(f"{where}.seed must be >= 0, got {self.seed}")
        w = self.answer_weight
        if isinstance(w, bool) or not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 1.0):
            raise SpecError(f"{where}.answer_weight must be a finite number >= 1 (the answers' weight in the "
                            f"attention-transfer loss; 1 = every position alike), got {w}")
        if self.style not in STYLES:
            raise SpecError(f"{where}.style must be one of {', '.join(STYLES)} (template facts, repeats of the text's own "
                            f"cues, or either), got {self.style!r}")
        return self


@dataclass(frozen=True)
class RecallFact:
    """One placed fact. Positions index the sequence; ``*_stop`` is exclusive."""
    fact_start: int
    fact_stop: int
    qa_start: int
    qa_stop: int
    fact_value: int  # where the value's tokens start (after the fact's wording, or a repeat's cue)
    answer_value: int  # where they start inside the answer (answer_value - fact_stop >= min_distance)
    value_ids: tuple[int, ...]


class RecallInserter:
    """Rewrites ``(seq_len,)`` int token sequences; see the module docstring.

    Args:
        config: a checked :class:`RecallConfig`.
        encode: ``text -> ids`` of the training tokenizer without special tokens
            (``retrofit.data.packing.make_tokenize(tokenizer, special_tokens=False)``).
    """

    def __init__(self, config: RecallConfig, encode: Callable[[str], list[int]]):
        self.config = config.check()
        self.encode = encode

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, int(index)])

    def _snippets(self, rng: np.random.Generator) -> list[tuple[list[int], int, list[int], int, list[int]]]:
        """``[(fact ids, value offset, question+answer ids, value offset, value ids)]``, one per fact;
        a repeat's cue is :data:`KEEP` in both (filled in from the sequence by :meth:`__call__`)."""
        k, style = self.config.facts, self.config.style
        out = []
        for name in rng.choice(len(NAMES), size=k, replace=k > len(NAMES)).tolist():
            if style == "repeats" or (style == "mixed" and rng.random() < 0.5):
                out.append(self._repeat(rng))
                continue
            pre, post, question, a_pre, a_post, kind = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
            slots = {"name": NAMES[name], "thing": THINGS[int(rng.integers(len(THINGS)))],
                     "place": PLACES[int(rng.integers(len(PLACES)))]}
            if kind == "word":
                pool = COLOURS if "colour" in question else WORDS
                value = pool[int(rng.integers(len(pool)))]
            else:
                value = _number(rng)
            value_ids = self.encode(" " + value)
            head = self.encode("\n" + pre.format(**slots))
            fact = head + value_ids + self.encode(_spaced(post.format(**slots)) + "\n")
            ask = self.encode("\n" + question.format(**slots) + " " + a_pre.format(**slots))
            qa = ask + value_ids + self.encode(_spaced(a_post.format(**slots)) + "\n")
            out.append((fact, len(head), qa, len(ask), value_ids))
        return out

    def _repeat(self, rng: np.random.Generator) -> tuple[list[int], int, list[int], int, list[int]]:
        """A cue of the text's own tokens, then a number (two in three) or a word; written twice."""
        cue = int(rng.integers(CUE_TOKENS[0], CUE_TOKENS[1] + 1))
        value = WORDS[int(rng.integers(len(WORDS)))] if rng.random() < 1 / 3 else _number(rng)
        value_ids = self.encode(" " + value)
        snippet = [KEEP] * cue + value_ids
        return snippet, cue, list(snippet), cue, value_ids

    def _layout(self, length: int, index: int) -> list[tuple[RecallFact, list[int], list[int]]] | None:
        """``[(placement, fact ids, question+answer ids)]`` of sequence ``index``, or None (not rewritten)."""
        c = self.config
        rng = self._rng(index)
        if not rng.random() < c.share:
            return None
        snippets = self._snippets(rng)
        order = rng.permutation(len(snippets)).tolist()
        slack = length - 1 - c.min_distance - sum(len(s[0]) + len(s[2]) for s in snippets)
        if slack < 0:
            return None
        # slack split at random over the gaps before each fact, between the facts and the
        # questions (on top of min_distance), before each question and after the last one
        cuts = np.sort(rng.integers(0, slack + 1, size=2 * len(snippets) + 1))
        gaps = np.diff(np.concatenate([[0], cuts, [slack]])).tolist()
        pos, fact_at = 1, []
        for fact, *_ in snippets:
            pos += gaps.pop(0)
            fact_at.append(pos)
            pos += len(fact)
        pos += c.min_distance
        placed: dict[int, tuple[RecallFact, list[int], list[int]]] = {}
        for i in order:
            fact, f_off, qa, q_off, value_ids = snippets[i]
            pos += gaps.pop(0)
            where = RecallFact(fact_at[i], fact_at[i] + len(fact), pos, pos + len(qa), fact_at[i] + f_off, pos + q_off,
                               tuple(value_ids))
            placed[i] = (where, fact, qa)
            pos += len(qa)
        return [placed[i] for i in range(len(snippets))]

    def plan(self, length: int, index: int) -> list[RecallFact] | None:
        """Where sequence ``index``'s (``length`` tokens) snippets go, in fact order, or None: not
        rewritten (not drawn, or too short for the snippets with ``min_distance`` between)."""
        layout = self._layout(length, index)
        return None if layout is None else [p for p, _, _ in layout]

    def answer_mask(self, length: int, index: int) -> np.ndarray:
        """``(length,)`` bool: True at the positions of sequence ``index`` whose next token is one of an
        answer's value tokens (``answer_value - 1`` onwards: where the model must have carried the fact
        across ``min_distance`` tokens); all False when the sequence is not rewritten."""
        mask = np.zeros(length, dtype=bool)
        for p in self.plan(length, index) or ():
            mask[p.answer_value - 1: p.answer_value - 1 + len(p.value_ids)] = True
        return mask

    def position_weights(self, length: int, index: int) -> np.ndarray:
        """``(length,)`` float32 loss weights of sequence ``index``: ``answer_weight`` where
        :meth:`answer_mask` is True, 1 everywhere else."""
        return np.where(self.answer_mask(length, index), np.float32(self.config.answer_weight), np.float32(1.0))

    def __call__(self, ids: np.ndarray, index: int) -> np.ndarray:
        """``ids`` (``(seq_len,)`` ints) with sequence ``index``'s snippets written in: a new array of
        the same shape and dtype, or ``ids`` itself when the sequence is not rewritten."""
        layout = self._layout(len(ids), index)
        if layout is None:
            return ids
        out = ids.copy()
        for p, fact, qa in layout:
            fact, qa = np.asarray(fact), np.asarray(qa)
            out[p.fact_start:p.fact_stop] = np.where(fact == KEEP, ids[p.fact_start:p.fact_stop], fact)
            cue = np.flatnonzero(qa == KEEP)  # an answer's KEEP at j: the fact's token j (a repeat's cue)
            qa[cue] = out[p.fact_start + cue]
            out[p.qa_start:p.qa_stop] = qa
        return out


def _number(rng: np.random.Generator) -> str:
    """3 to 7 digits, no leading zero."""
    digits = int(rng.integers(3, 8))
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _spaced(text: str) -> str:
    """A word after the value starts with a space; punctuation follows it directly."""
    return text if not text or not text[0].isalnum() else " " + text
