"""RULER's synthetic tasks, generated offline in tokens (exact lengths, any tokenizer, seeded).

The prompts, needles and answer prefixes are those of lm-eval's ``ruler`` tasks (NVIDIA's RULER,
Apache-2.0), whose generators download Paul Graham essays and nltk data and size prompts only
approximately. Here a prompt is assembled from separately tokenized pieces::

    FRAME.head  HEAD  unit unit needle unit ... unit[:r]  TAIL  FRAME.tail  ANSWER_PREFIX

so it is exactly ``length - max_new_tokens`` tokens (RULER counts the answer's budget in the
sequence length): as many whole haystack units (sentences, list entries, words) as fit, the
needles among them, and the last ``r`` tokens (fewer than one unit) taken from the start of one
more haystack unit. Every sample is seeded by ``(seed, task, length, index)`` alone.

Tasks (lm-eval names; RULER's 13 less its two QA tasks, which need SQuAD / HotpotQA):

==================  =========================================================================
niah_single_1       one needle (word key -> 7-digit number) in a repeated noise sentence
niah_single_2       one needle in essays
niah_single_3       one needle (word key -> UUID) in essays
niah_multikey_1     the needle among 3 distractor needles (other keys) in essays
niah_multikey_2     the needle in a haystack made only of distractor needles
niah_multikey_3     as multikey_2 with UUID keys and values
niah_multivalue     one key with 4 values in essays (all 4 expected)
niah_multiquery     4 keys asked at once in essays (all 4 values expected)
ruler_vt            variable tracking: a 4-hop chain ``VAR B = VAR A`` in noise (one example first)
ruler_cwe           common words: the 10 words repeated most often in a numbered word list
ruler_fwe           frequent words: the 3 most frequent coded words of a Zipf-distributed text
==================  =========================================================================
"""
from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from retrofit.errors import DataError
from retrofit.eval import essays, words
from retrofit.eval.prompting import Frame, answer_prefix_ids
from retrofit.eval.windows import encode

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
REPEAT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
             "are assgined the value {query}, they are:")  # sic: RULER's spelling, kept for comparability
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")
CWE_ANSWER = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER = "Answer: According to the coded text above, the three most frequently appeared words are:"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's needle depths (percent) in essays


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task. kind: niah | vt | cwe | fwe; haystack (niah): repeat | essay | needle;
    type_k / type_v: words | numbers | uuids; num_k / num_v / num_q: keys, values per key, keys
    asked; max_new_tokens: RULER's generation budget for the task."""

    name: str
    kind: str
    max_new_tokens: int
    haystack: str = ""
    type_k: str = "words"
    type_v: str = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("niah_single_1", "niah", 128, "repeat"),
    TaskSpec("niah_single_2", "niah", 128, "essay"),
    TaskSpec("niah_single_3", "niah", 128, "essay", type_v="uuids"),
    TaskSpec("niah_multikey_1", "niah", 128, "essay", num_k=4),
    TaskSpec("niah_multikey_2", "niah", 128, "needle"),
    TaskSpec("niah_multikey_3", "niah", 128, "needle", type_k="uuids", type_v="uuids"),
    TaskSpec("niah_multivalue", "niah", 128, "essay", num_v=4),
    TaskSpec("niah_multiquery", "niah", 128, "essay", num_q=4),
    TaskSpec("ruler_vt", "vt", 30),
    TaskSpec("ruler_cwe", "cwe", 120),
    TaskSpec("ruler_fwe", "fwe", 50),
)}


@dataclass
class Sample:
    """One prompt: ``ids`` (exactly ``length - max_new_tokens`` tokens) and the strings its answer
    must contain (``outputs``); ``needles``: the token spans [start, end) of what must be found."""

    task: str
    length: int
    index: int
    ids: list[int]
    outputs: list[str]
    max_new_tokens: int
    query: str = ""
    needles: list[tuple[int, int]] = field(default_factory=list)


class EssayUnits:
    """The essay haystack as sentence units (``" " + sentence``), tokenized lazily and shared by
    every sample of a run; cycles from the start when a prompt needs more than the essays hold."""

    def __init__(self, tokenizer: Any, haystack: essays.Haystack):
        self.tokenizer = tokenizer
        self.haystack = haystack
        self._sentences: list[str] | None = None
        self._ids: list[list[int]] = []
        self.repeated = False

    def __iter__(self) -> Iterator[list[int]]:
        if self._sentences is None:
            self._sentences = essays.sentences(essays.haystack_text(self.haystack))
            if not self._sentences:
                raise DataError(f"haystack {self.haystack.name!r} has no sentences")
        i = 0
        while True:
            while i >= len(self._ids):
                n = len(self._ids)
                if n >= len(self._sentences):  # all encoded: go round again
                    self.repeated = True
                    i = 0
                    continue
                batch = self._sentences[n : n + 512]
                self._ids.extend(list(x) for x in self.tokenizer([" " + s for s in batch],
                                                                 add_special_tokens=False)["input_ids"])
            yield self._ids[i]
            i += 1


# ----------------------------------------------------------------------------------- building blocks
def _rng(seed: int, task: str, length: int, index: int, extra: str = "") -> random.Random:
    return random.Random(f"{seed}/{task}/{length}/{index}{extra}")


def _random_value(rng: random.Random, kind: str, keys: list[str]) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(keys)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise DataError(f"unknown needle type {kind!r}")


def _take(units: Iterator[list[int]], budget: int) -> tuple[list[list[int]], list[int]]:
    """Whole units while they fit in ``budget`` tokens, and the first ``budget - used`` tokens of
    the next one (the pad that makes the length exact)."""
    taken: list[list[int]] = []
    used = 0
    for u in units:
        if used + len(u) > budget:
            return taken, u[: budget - used]
        taken.append(u)
        used += len(u)
        if used == budget:
            return taken, []
    raise DataError("the haystack ran out")  # unreachable for the endless unit streams used here


def _frame_parts(tokenizer: Any, frame: Frame, head: str, tail: str, answer: str) -> tuple[list[int], list[int]]:
    prefix = list(frame.head) + encode(tokenizer, head)
    suffix = encode(tokenizer, tail) + list(frame.tail) + answer_prefix_ids(tokenizer, frame, answer)
    return prefix, suffix


def _interleave(filler: list[list[int]], needles: list[list[int]],
                where: list[int]) -> tuple[list[list[int]], list[int]]:
    """The ``filler`` units with ``needles[j]`` placed before filler unit ``where[j]`` (``where`` sorted;
    ``len(filler)``: after the last): ``(body units, marks)``, ``marks`` the needles' indices in the
    body (for :func:`_assemble`)."""
    body: list[list[int]] = []
    marks: list[int] = []
    j = 0
    for i in range(len(filler) + 1):
        while j < len(needles) and where[j] == i:
            marks.append(len(body))
            body.append(needles[j])
            j += 1
        if i < len(filler):
            body.append(filler[i])
    return body, marks


def _assemble(prefix: list[int], body: list[list[int]], marks: list[int], pad: list[int], suffix: list[int],
              total: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``prefix + body units + pad + suffix``; ``marks``: indices of body units whose spans to return."""
    ids = list(prefix)
    spans = []
    marked = set(marks)
    for k, u in enumerate(body):
        if k in marked:
            spans.append((len(ids), len(ids) + len(u)))
        ids.extend(u)
    ids.extend(pad)
    ids.extend(suffix)
    if len(ids) != total:
        raise AssertionError(f"prompt has {len(ids)} tokens, {total} wanted")
    return ids, spans


def _too_short(task: str, length: int, need: int) -> DataError:
    return DataError(f"{task} at length {length} is too short: the template, needles and answer budget alone "
                     f"take {need} tokens")


def _repeat(unit: list[int]) -> Iterator[list[int]]:
    while True:
        yield unit


# ----------------------------------------------------------------------------------- the four kinds
def _niah(spec: TaskSpec, tok: Any, length: int, index: int, frame: Frame, seed: int, max_new: int,
          essay_units: EssayUnits | None) -> Sample:
    rng = _rng(seed, spec.name, length, index)
    keys_pool = words.key_words()
    num_k = max(spec.num_k, spec.num_q)
    keys: list[str] = []
    values: list[list[str]] = []
    seen: set[str] = set()
    needles: list[str] = []
    while len(keys) < num_k:
        k = _random_value(rng, spec.type_k, keys_pool)
        if any(k in o or o in k for o in keys):  # no key inside another: each key is found once
            continue
        keys.append(k)
        vals = []
        while len(vals) < spec.num_v:
            v = _random_value(rng, spec.type_v, keys_pool)
            if v in seen or any(v in k2 or k2 in v for k2 in keys):
                continue
            seen.add(v)
            vals.append(v)
            needles.append(NEEDLE.format(type_needle_v=spec.type_v, key=k, value=v))
        values.append(vals)
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), spec.num_q)
    queries = [keys[i] for i in asked]
    outputs = [a for i in asked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    template, type_v = NIAH_TEMPLATE, spec.type_v
    if spec.num_q * spec.num_v == 1:  # RULER's singular wording
        template = (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("answers", "answer"))
        type_v = type_v[:-1]
    head, tail = template.format(type_needle_v=type_v, context="\0", query=query).split("\0")
    gen_prefix = (f"The special magic {spec.type_v[:-1]} for {query} mentioned in the provided text is"
                  if spec.num_q * spec.num_v == 1 else
                  f"The special magic {spec.type_v} for {query} mentioned in the provided text are")
    sep = " " if spec.haystack == "essay" else "\n"
    prefix, suffix = _frame_parts(tok, frame, head.rstrip("\n") if sep == "\n" else head, tail, gen_prefix)
    needle_ids = [encode(tok, sep + n) for n in needles]
    total = length - max_new
    budget = total - len(prefix) - len(suffix) - sum(map(len, needle_ids))
    if budget < 0:
        raise _too_short(spec.name, length, total - budget)

    if spec.haystack == "repeat":
        units: Iterator[list[int]] = _repeat(encode(tok, sep + REPEAT_NOISE))
    elif spec.haystack == "needle":
        units = _distractors(tok, rng, spec, keys, seen, keys_pool)
    else:
        assert essay_units is not None
        units = iter(essay_units)
    filler, pad = _take(units, budget)
    n = len(filler)
    if spec.haystack == "essay":  # RULER: sentence positions at needle depths sampled from DEPTHS
        where = sorted(int(n * d / 100) for d in rng.sample(DEPTHS, len(needle_ids)))
    else:  # RULER: random line indices
        where = sorted(rng.sample(range(n + 1), len(needle_ids))) if n + 1 >= len(needle_ids) else [n] * len(needle_ids)
    ids, spans = _assemble(prefix, *_interleave(filler, needle_ids, where), pad, suffix, total)
    return Sample(spec.name, length, index, ids, outputs, max_new, query=query, needles=spans)


def _distractors(tok: Any, rng: random.Random, spec: TaskSpec, keys: list[str], values: set[str],
                 keys_pool: list[str]) -> Iterator[list[int]]:
    """Endless distractor needles (other keys and values, never containing a real key or value)."""
    while True:
        texts = []
        while len(texts) < 256:
            k = _random_value(rng, spec.type_k, keys_pool)
            v = _random_value(rng, spec.type_v, keys_pool)
            if any(k in o or o in k for o in keys) or v in values or any(v in o or o in v for o in keys):
                continue
            texts.append("\n" + NEEDLE.format(type_needle_v=spec.type_v, key=k, value=v))
        yield from (list(x) for x in tok(texts, add_special_tokens=False)["input_ids"])


def _vt(spec: TaskSpec, tok: Any, length: int, index: int, frame: Frame, seed: int, max_new: int,
        num_hops: int = 4, icl_noise: int = 20) -> Sample:
    rng = _rng(seed, spec.name, length, index)

    def chain(letters: int) -> tuple[list[str], list[str], str]:
        names: list[str] = []
        while len(names) < num_hops + 1:
            v = "".join(rng.choices(string.ascii_uppercase, k=letters))
            if v not in names:
                names.append(v)
        value = str(rng.randint(10000, 99999))
        stmts = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
        return names, stmts, value

    # one worked example first (lm-eval's few-shot example: 3-letter names, a noise text that keeps the
    # example within 500 tokens)
    icl_names, icl_stmts, icl_value = chain(3)

    def example(noise: int) -> str:
        lines = [REPEAT_NOISE + "\n"] * noise
        r = random.Random(f"{seed}/{spec.name}/{length}/{index}/icl")
        for j, pos in enumerate(sorted(r.choices(range(noise + 1), k=len(icl_stmts)))):
            lines.insert(pos + j, icl_stmts[j])
        return (VT_TEMPLATE.format(context=" ".join(lines), query=icl_value) + " "
                + VT_ANSWER.format(num_v=num_hops + 1, query=icl_value) + " " + " ".join(icl_names) + "\n\n")

    noise = icl_noise
    while noise > 1 and len(encode(tok, example(noise))) > 500:
        noise -= 1
    icl = example(noise)
    names, stmts, value = chain(5)
    while value == icl_value:
        value = str(rng.randint(10000, 99999))
        stmts[0] = f"VAR {names[0]} = {value}"
    head, tail = VT_TEMPLATE.format(context="\0", query=value).split("\0")
    prefix, suffix = _frame_parts(tok, frame, icl + head, tail, VT_ANSWER.format(num_v=num_hops + 1, query=value))
    stmt_ids = [encode(tok, " " + s) for s in stmts]
    total = length - max_new
    budget = total - len(prefix) - len(suffix) - sum(map(len, stmt_ids))
    if budget < 0:
        raise _too_short(spec.name, length, total - budget)
    filler, pad = _take(_repeat(encode(tok, " " + REPEAT_NOISE + "\n")), budget)
    n = len(filler)
    where = sorted(rng.choices(range(n + 1), k=len(stmt_ids))) if n else [0] * len(stmt_ids)
    ids, spans = _assemble(prefix, *_interleave(filler, stmt_ids, where), pad, suffix, total)
    return Sample(spec.name, length, index, ids, names, max_new, query=value, needles=spans)


def _cwe(spec: TaskSpec, tok: Any, length: int, index: int, frame: Frame, seed: int, max_new: int,
         num_cw: int = 10) -> Sample:
    freq_cw, freq_ucw = (6, 1) if length < 4096 else (30, 3)  # RULER's repeats below / from 4K
    head, tail = CWE_TEMPLATE.format(context="\0").split("\0")
    prefix, suffix = _frame_parts(tok, frame, head.rstrip("\n"), tail, CWE_ANSWER)
    total = length - max_new
    budget = total - len(prefix) - len(suffix)
    order = words.vocabulary(num_cw + max(budget, 0) // max(freq_ucw, 1) + 64)
    _rng(seed, spec.name, length, index, "/vocab").shuffle(order)

    def entries(n: int) -> tuple[list[str], list[list[int]]]:
        rng = _rng(seed, spec.name, length, index, f"/{n}")
        chosen = order[:n]
        lst = chosen[:num_cw] * freq_cw + chosen[num_cw:] * freq_ucw
        rng.shuffle(lst)
        texts = [f"\n{i + 1}. {w}" if i == 0 else f" {i + 1}. {w}" for i, w in enumerate(lst)]
        return lst, [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]] if texts else []

    def size(n: int) -> int:
        return sum(map(len, entries(n)[1]))

    lo, hi = num_cw, num_cw
    if size(lo) > budget:
        raise _too_short(spec.name, length, total - budget + size(lo))
    while hi < len(order) - 64 and size(hi) <= budget:
        lo, hi = hi, min(len(order) - 64, hi * 2)
    while hi - lo > 1:  # largest n that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    n = hi if size(hi) <= budget else lo
    lst, body = entries(n)
    used = sum(map(len, body))
    extra = [f" {len(lst) + k + 1}. {w}" for k, w in enumerate(order[n : n + 64])]  # singletons: the pad
    filler, pad = _take(iter([list(x) for x in tok(extra, add_special_tokens=False)["input_ids"]]), budget - used)
    ids, _ = _assemble(prefix, body + filler, [], pad, suffix, total)
    return Sample(spec.name, length, index, ids, order[:num_cw], max_new)


def _zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta(alpha), alpha > 1 (partial sum + Euler-Maclaurin tail)."""
    s = sum(k**-alpha for k in range(1, terms + 1))
    return s + terms ** (1 - alpha) / (alpha - 1) - terms**-alpha / 2


def _fwe(spec: TaskSpec, tok: Any, length: int, index: int, frame: Frame, seed: int, max_new: int,
         coded_wordlen: int = 6, alpha: float = 2.0) -> Sample:
    rng = _rng(seed, spec.name, length, index)
    vocab_size = max(length // 50, 8)  # RULER: max_seq_length // 50
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < vocab_size:
        w = "".join(rng.choices(string.ascii_lowercase, k=coded_wordlen))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    vocab[0] = "..."  # the top rank is noise (the dots the question says to ignore)
    head, tail = FWE_TEMPLATE.format(context="\0").split("\0")
    prefix, suffix = _frame_parts(tok, frame, head.rstrip(" "), tail, FWE_ANSWER)
    total = length - max_new
    budget = total - len(prefix) - len(suffix)
    unit = [list(x) for x in tok([" " + w for w in vocab], add_special_tokens=False)["input_ids"]]
    z = _zeta(alpha)

    def counts(num_words: int) -> list[int]:
        return [int(num_words * (k**-alpha) / z) for k in range(1, vocab_size + 1)]

    def size(num_words: int) -> int:
        return sum(c * len(u) for c, u in zip(counts(num_words), unit))

    lo, hi = 0, 16
    while size(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    c = counts(lo)
    if not (c[1] > c[2] > c[3] > c[4] > 0):
        raise _too_short(spec.name, length, total)
    seq = [k for k, ck in enumerate(c) for _ in range(ck)]
    rng.shuffle(seq)
    body = [unit[k] for k in seq]
    filler, pad = _take(_repeat(unit[0]), budget - sum(map(len, body)))
    ids, _ = _assemble(prefix, body + filler, [], pad, suffix, total)
    return Sample(spec.name, length, index, ids, vocab[1:4], max_new)


_KINDS: dict[str, Callable[..., Sample]] = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise DataError(f"unknown RULER task {name!r}: known are {', '.join(TASKS)}")
    return TASKS[name]


def make_sample(task: str, tokenizer: Any, length: int, index: int, *, frame: Frame, seed: int = 0,
                max_new_tokens: int | None = None, essay_units: EssayUnits | None = None) -> Sample:
    """Sample ``index`` of ``task`` at sequence length ``length``: a prompt of exactly
    ``length - max_new_tokens`` tokens (default: the task's RULER budget). ``essay_units`` (for the
    essay tasks; built from the default haystack when None) can be shared between calls."""
    spec = get_task(task)
    max_new = spec.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if max_new < 1:
        raise DataError(f"max_new_tokens must be at least 1, got {max_new}")
    if max_new >= length:  # a length counts the prompt and the answer budget together, as RULER does
        budget = "--max-new-tokens" if max_new_tokens is not None else f"{task}'s RULER answer budget"
        raise DataError(f"length {length} leaves no room for a prompt beside {max_new} answer tokens ({budget}): "
                        f"give lengths above {max_new}" + (" or a smaller --max-new-tokens" if max_new_tokens else ""))
    if spec.kind == "niah":
        if spec.haystack == "essay" and essay_units is None:
            essay_units = EssayUnits(tokenizer, essays.resolve_haystack())
        return _niah(spec, tokenizer, length, index, frame, seed, max_new, essay_units)
    return _KINDS[spec.kind](spec, tokenizer, length, index, frame, seed, max_new)
