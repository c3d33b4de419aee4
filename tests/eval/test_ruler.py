"""RULER-style generators (exact lengths, answers present exactly where they must be, seeds
reproduce) and scoring (a model that gives the expected answers scores 100, one that does not 0)."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from retrofit.errors import DataError
from retrofit.eval import prompting, ruler, ruler_tasks
from retrofit.eval.generation import recall

NIAH = [t for t, s in ruler_tasks.TASKS.items() if s.kind == "niah"]
L = 1024


@pytest.fixture(scope="module")
def frame(tokenizer):
    return prompting.build_frame(tokenizer, chat=False, bos_id=tokenizer.bos_token_id)


@pytest.fixture(scope="module")
def units(tokenizer):
    from retrofit.eval import essays

    return ruler_tasks.EssayUnits(tokenizer, essays.resolve_haystack())


def _sample(tokenizer, frame, units, task, length=L, index=0, seed=0, **kw):
    return ruler_tasks.make_sample(task, tokenizer, length, index, frame=frame, seed=seed, essay_units=units, **kw)


@pytest.mark.parametrize("task", list(ruler_tasks.TASKS))
def test_lengths_are_exact_and_seeds_reproduce(tokenizer, frame, units, task):
    for length in (L, 1500):
        s = _sample(tokenizer, frame, units, task, length)
        assert len(s.ids) == length - ruler_tasks.TASKS[task].max_new_tokens == length - s.max_new_tokens
        assert s.ids[0] == tokenizer.bos_token_id and s.outputs
        assert _sample(tokenizer, frame, units, task, length).ids == s.ids
    assert _sample(tokenizer, frame, units, task, seed=1).ids != s.ids or task == "niah_single_1"
    assert _sample(tokenizer, frame, units, task, index=1).outputs != _sample(tokenizer, frame, units, task).outputs
    assert len(_sample(tokenizer, frame, units, task, max_new_tokens=7).ids) == L - 7


@pytest.mark.parametrize("task", NIAH)
def test_niah_answers_are_in_the_prompt_exactly_once_inside_their_needles(tokenizer, frame, units, task):
    spec = ruler_tasks.TASKS[task]
    s = _sample(tokenizer, frame, units, task)
    text = tokenizer.decode(s.ids, skip_special_tokens=True)
    assert len(s.outputs) == spec.num_v * spec.num_q
    assert len(s.needles) == max(spec.num_k, spec.num_q) * spec.num_v
    needle_texts = [tokenizer.decode(s.ids[a:b]) for a, b in s.needles]
    for value in s.outputs:
        assert text.count(value) == 1
        assert sum(value in n for n in needle_texts) == 1
    for key in s.query.replace(", and ", ", ").split(", "):
        assert sum(key in n for n in needle_texts) == spec.num_v  # the asked key(s), in their needles only
    assert text.rstrip().endswith("mentioned in the provided text " + ("is" if len(s.outputs) == 1 else "are"))


def test_multikey_has_distractors_and_multikey_2_is_all_needles(tokenizer, frame, units):
    s = _sample(tokenizer, frame, units, "niah_multikey_1")
    text = tokenizer.decode(s.ids, skip_special_tokens=True)
    assert text.count("One of the special magic numbers for") == 4
    s2 = _sample(tokenizer, frame, units, "niah_multikey_2")
    body = tokenizer.decode(s2.ids, skip_special_tokens=True).split("afterwards.\n")[1].split("\nWhat is")[0]
    lines = body.split("\n")
    assert len(lines) > 10 and all(ln.startswith("One of the special magic numbers for") for ln in lines[:-1])


def test_variable_tracking_chain(tokenizer, frame, units):
    s = _sample(tokenizer, frame, units, "ruler_vt")
    text = tokenizer.decode(s.ids, skip_special_tokens=True)
    names, value = s.outputs, s.query
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    context = text.split("Memorize and track")[-1].split("\nQuestion:")[0]
    assert context.count(value) == 1 and f"VAR {names[0]} = {value}" in context
    for a, b in zip(names, names[1:]):
        assert f"VAR {b} = VAR {a}" in context
    assert text.count("Answer: According to the chain(s)") == 2  # the worked example, then the question


def test_common_words_are_the_ten_most_repeated(tokenizer, frame, units):
    for length, (cf, uf) in ((L, (6, 1)), (4096, (30, 3))):
        s = _sample(tokenizer, frame, units, "ruler_cwe", length)
        text = tokenizer.decode(s.ids, skip_special_tokens=True)
        listing = text.split("most often.\n")[1].split("\nQuestion:")[0]
        counts = Counter(re.findall(r"\d+\. ([a-z-]+)", listing))
        assert len(s.outputs) == 10 and all(counts[w] == cf for w in s.outputs)
        assert all(c <= uf for w, c in counts.items() if w not in s.outputs)


def test_frequent_words_are_the_three_most_frequent(tokenizer, frame, units):
    s = _sample(tokenizer, frame, units, "ruler_fwe")
    text = tokenizer.decode(s.ids, skip_special_tokens=True)
    coded = text.split("coded words.")[1].split("\nQuestion:")[0]
    counts = Counter(w for w in coded.split() if w != "...")
    top = [w for w, _ in counts.most_common(4)]
    assert top[:3] == s.outputs and counts[top[2]] > counts[top[3]]


def test_chat_frame_keeps_lengths_exact(tokenizer, units):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    frame = prompting.build_frame(tok, chat=True, bos_id=tok.bos_token_id)
    for task in ("niah_single_2", "ruler_vt", "ruler_cwe"):
        s = ruler_tasks.make_sample(task, tok, L, 0, frame=frame, essay_units=units)
        assert len(s.ids) == L - s.max_new_tokens
        text = tok.decode(s.ids, skip_special_tokens=True)
        assert text.startswith("<|user|>\n") and "<|end|>\n<|assistant|>\n" in text


def test_too_short_and_unknown_tasks_are_clear_errors(tokenizer, frame, units):
    with pytest.raises(DataError, match="too short"):
        _sample(tokenizer, frame, units, "niah_multivalue", 200)
    with pytest.raises(DataError, match="unknown RULER task"):
        _sample(tokenizer, frame, units, "qa_squad")


def test_scoring_is_rulers_string_match_all():
    assert recall(" 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert recall("\x00  ABCDE\n", ["abcde", "FGHIJ"]) == 0.5
    assert recall("nothing", ["1234567"]) == 0.0


def test_cli_task_list_matches_the_generators():
    from retrofit.eval.evaluators import ruler as ev

    assert ev.TASKS == tuple(ruler_tasks.TASKS)


def test_a_model_that_gives_the_answers_scores_100_and_one_that_does_not_0(tokenizer, frame, tmp_path):
    from .stubs import oracle, says

    tasks = list(ruler_tasks.TASKS)
    # 60 new tokens: room for every answer in the tiny tokenizer's long spellings (VT's budget is 30)
    prompts, _ = ruler.build_prompts(tokenizer, tasks=tasks, lengths=[L], samples=2, frame=frame, max_new_tokens=60)
    right = oracle({tuple(p["ids"]): ", ".join(p["outputs"]) for p in prompts}, tokenizer, name="oracle")
    wrong = says(tokenizer, " 42, WXYZ, nothing", name="wrong")
    res = ruler.run_ruler(right, tokenizer=tokenizer, baseline=wrong, baseline_tokenizer=tokenizer, tasks=tasks,
                          lengths=[L], samples=2, max_new_tokens=60, out=tmp_path, progress=False,
                          chat_template="off")
    assert len(right.prompts) == len(wrong.prompts) == len(prompts) == 2 * len(tasks)
    assert res["results"]["model"]["mean"] == 1.0 and res["results"]["baseline"]["mean"] == 0.0
    assert all(res["results"]["model"]["scores"][t][str(L)] == 1.0 for t in tasks)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["chat_template"] is False and data["settings"]["max_new_tokens"]["ruler_vt"] == 60
    table = (tmp_path / "table.md").read_text()
    assert "Chat template: off" in table and "| oracle | niah_single_1 | 100.0 |" in table
    assert (tmp_path / "ruler.png").is_file()


def test_real_model_generates_through_chunked_prefill(base_dir, tokenizer):
    res = ruler.run_ruler(str(base_dir), tasks=["niah_single_1", "ruler_fwe"], lengths=[600], samples=1,
                          prefill_chunk=128, max_new_tokens=8, progress=False)
    recs = res["results"]["model"]["samples"]
    assert len(recs) == 2 and all(0.0 <= r["score"] <= 1.0 and isinstance(r["output"], str) for r in recs)
    assert res["settings"]["prefill_chunk"] == 128
