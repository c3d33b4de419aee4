"""Multiple-choice tasks scored both ways: lettered prompts, answer parsing, and exact scores of
models whose answers are known (log-likelihood and generation), through lm-eval as the harness runs it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrofit.eval import choice_generation as cg
from retrofit.eval import harness

from .lm_stubs import KnownLM

MC_TEST = [json.loads(line) for line in
           (Path(harness.TASKS_DIR) / "retrofit_tiny" / "mc_test.jsonl").read_text().splitlines() if line.strip()]


def share(pred) -> float:
    return sum(pred(doc) for doc in MC_TEST) / len(MC_TEST)


def test_lettered_prompt():
    text = "Question: What colour is grass?\nAnswer:"
    assert cg.lettered_prompt(text, ["blue", " green"]) == (
        "Question: What colour is grass?\nA. blue\nB. green\nAnswer:")
    mmlu = "Q?\nA. x\nB. y\nAnswer:"
    assert cg.lettered_prompt(mmlu, ["A", "B"]) == mmlu  # already lettered: kept as is
    assert cg.lettered_prompt("", ["one", "two"]) == "A. one\nB. two\nAnswer:"


@pytest.mark.parametrize("answer, expected", [
    (" B", 1), ("B.", 1), ("(C)", 2), (" D) winter", 3), ("A\nB", 0), (" winter", 3), ("Winter.", 3),
    ("A lot of them", None), ("E", None), ("", None), ("spring or winter", None),
])
def test_parse_answer(answer, expected):
    assert cg.parse_answer(answer, ["summer", "spring", "autumn", "winter"]) == expected


def test_several_contexts_one_continuation():
    """Winogrande's form: doc_to_text is the gold index, the choices are contexts."""

    class Source:
        config = type("C", (), {"target_delimiter": " "})()

        def doc_to_text(self, doc):
            return 1

        def doc_to_choice(self, doc):
            return ["The cup broke the table", "The table broke the cup"]

        def doc_to_target(self, doc):
            return "because it was hard."

    fmt = cg._Formatter(Source())
    assert fmt.text({}) == ("A. The cup broke the table because it was hard.\n"
                            "B. The table broke the cup because it was hard.\nAnswer:")
    assert fmt.target({}) == "B"
    assert fmt.score({}, [" B"]) == {"exact_match": 1.0, "valid": 1.0}
    assert fmt.score({}, [" maybe"]) == {"exact_match": 0.0, "valid": 0.0}


def _run(lm, score, shots=0):
    return harness.evaluate_model(lm, ["retrofit_tiny_mc"], num_fewshot=shots, bootstrap_iters=0, score=score)


@pytest.mark.parametrize("by", ["letter", "text"])
def test_choice_zero_scores_the_share_of_gold_zero_both_ways(by):
    res = _run(KnownLM(choose=lambda doc: 0, by=by), "both")["results"]
    expected = share(lambda doc: doc["answer"] == 0)
    assert expected == 0.25
    assert res["retrofit_tiny_mc"]["acc,none"] == expected
    assert res["retrofit_tiny_mc:gen"]["exact_match,none"] == expected
    assert res["retrofit_tiny_mc:gen"]["valid,none"] == 1.0


def test_known_answers_score_exactly():
    half = {doc["question"] for doc in MC_TEST[::2]}
    lm = KnownLM(choose=lambda doc: doc["answer"] if doc["question"] in half else (doc["answer"] + 1) % 4)
    res = _run(lm, "both")["results"]
    assert res["retrofit_tiny_mc"]["acc,none"] == res["retrofit_tiny_mc:gen"]["exact_match,none"] == 0.5
    oracle = _run(KnownLM(choose=lambda doc: doc["answer"]), "generation")["results"]
    assert "retrofit_tiny_mc" not in oracle  # generation only: no log-likelihood run
    assert oracle["retrofit_tiny_mc:gen"]["exact_match,none"] == 1.0


def test_answers_that_name_no_choice_score_zero():
    lm = KnownLM(choose=lambda doc: 0, by="text")
    lm.generate_until = lambda requests: [" I do not know" for _ in requests]
    res = _run(lm, "generation")["results"]["retrofit_tiny_mc:gen"]
    assert res["exact_match,none"] == 0.0 and res["valid,none"] == 0.0


def test_prompts_list_the_choices_and_shots_show_gold_letters():
    lm = KnownLM()
    _run(lm, "generation", shots=2)
    by_question = {p.rsplit("Question: ", 1)[1].split("\n")[0]: p for p in lm.prompts}
    assert set(by_question) == {doc["question"] for doc in MC_TEST}
    doc = MC_TEST[1]
    prompt = by_question[doc["question"]]
    tail = "\n".join([f"Question: {doc['question']}"] + [f"{'ABCD'[i]}. {c}" for i, c in enumerate(doc["choices"])])
    assert prompt.endswith(tail + "\nAnswer:")
    shots = prompt.split("\n\n")[:-1]
    assert len(shots) == 2
    train = {json.loads(line)["question"]: json.loads(line) for line in
             (Path(harness.TASKS_DIR) / "retrofit_tiny" / "mc_train.jsonl").read_text().splitlines() if line.strip()}
    for shot in shots:
        q = shot.split("\n")[0].removeprefix("Question: ")
        assert shot.endswith(f"Answer: {'ABCD'[train[q]['answer']]}")


def test_group_scores_weight_subtasks_by_size():
    results = {"a:gen": {"exact_match,none": 1.0, "valid,none": 1.0},
               "b:gen": {"exact_match,none": 0.0, "valid,none": 0.5}}
    samples = {"a:gen": {"effective": 3}, "b:gen": {"effective": 1}}
    groups = cg.group_scores(results, {"top": ["mid"], "mid": ["a", "b"], "mixed": ["a", "c"]}, samples)
    assert set(groups) == {"top:gen", "mid:gen"}  # "mixed" has a leaf without a variant
    assert groups["top:gen"]["exact_match,none"] == groups["mid:gen"]["exact_match,none"] == 0.75
    assert groups["mid:gen"]["valid,none"] == 0.875


def test_unknown_score_is_refused():
    from retrofit.errors import RetrofitError

    with pytest.raises(RetrofitError, match="loglik, generation, both"):
        _run(KnownLM(), "vote")


def test_run_harness_tables_show_both_columns(base_dir):
    res = harness.run_harness(str(base_dir), tasks="retrofit_tiny_mc", num_fewshot=1, limit=2, bootstrap_iters=0)
    header = res["table"].splitlines()[0]
    assert header.index("retrofit_tiny_mc\u2020 [1]") < header.index("retrofit_tiny_mc:gen [1]")
    gen = res["results"]["retrofit_tiny_mc:gen"]["model"]
    assert gen["primary_metric"] == "exact_match" and 0.0 <= gen["primary"] <= 1.0
    assert gen["samples"]["effective"] == 2
    assert res["settings"]["score"] == "both"
    only = harness.run_harness(str(base_dir), tasks="retrofit_tiny_mc", num_fewshot=0, limit=1, bootstrap_iters=0,
                               score="loglik")
    assert ":gen" not in only["table"]
