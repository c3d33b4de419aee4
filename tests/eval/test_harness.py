"""lm-eval bridge: the `retrofit` lm-eval model and the bundled offline tiny tasks, end to end."""
from __future__ import annotations

import json

import pytest

from retrofit.eval import harness
from retrofit.eval.lm_eval_cli import with_task_folder


def test_paper_fewshot_map():
    assert harness.PAPER_FEWSHOT == {
        "mmlu": 5, "hellaswag": 10, "lambada_openai": 0, "arc_challenge": 25,
        "arc_easy": 0, "winogrande": 5, "piqa": 0, "boolq": 0,
    }
    assert set(harness.PAPER_TASKS) == set(harness.PAPER_FEWSHOT) == set(harness.PRIMARY_METRIC)
    assert harness.parse_fewshot("3") == 3
    assert harness.parse_fewshot("piqa=1, boolq=2") == {"piqa": 1, "boolq": 2}
    assert harness.fewshot_for("hellaswag", None) == 10
    assert harness.fewshot_for("hellaswag", {"piqa": 1}) == 10
    assert harness.fewshot_for("other", None) is None


def test_run_harness_converted_beside_base(converted_dir, base_dir, tmp_path):
    res = harness.run_harness(
        str(converted_dir), baseline=str(base_dir), tasks="retrofit_tiny_mc,retrofit_tiny_gen,retrofit_tiny_rolling",
        num_fewshot="retrofit_tiny_mc=2", limit=4, batch_size=2, bootstrap_iters=0, out=tmp_path,
    )
    data = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "table.md").is_file()
    assert res["images"] == ["harness.png"] and (tmp_path / "harness.png").read_bytes()[:4] == b"\x89PNG"
    for task in ("retrofit_tiny_mc", "retrofit_tiny_gen", "retrofit_tiny_rolling"):
        for role in ("model", "baseline"):
            entry = data["results"][task][role]
            assert entry["primary"] is not None, (task, role)
            assert entry["samples"]["effective"] == (3 if task == "retrofit_tiny_rolling" else 4)
    mc = data["results"]["retrofit_tiny_mc"]["model"]
    assert mc["num_fewshot"] == 2 and mc["primary_metric"] == "acc_norm"
    assert 0.0 <= mc["metrics"]["acc"] <= 1.0
    assert data["results"]["retrofit_tiny_gen"]["model"]["num_fewshot"] == 0
    assert data["results"]["retrofit_tiny_rolling"]["model"]["metrics"]["word_perplexity"] > 1.0
    assert data["models"]["model"]["converted"] and not data["models"]["baseline"]["converted"]
    lines = res["table"].splitlines()
    assert "retrofit_tiny_mc\u2020 [2]" in lines[0]
    assert lines[2].startswith("| tiny-base") and lines[3].startswith("| tiny-base + macchiato")


def test_group_is_expanded_into_its_subtasks(base_dir):
    res = harness.run_harness(str(base_dir), tasks=["retrofit_tiny"], num_fewshot=0, limit=2, bootstrap_iters=0)
    header = res["table"].splitlines()[0]
    for sub in ("retrofit_tiny_mc", "retrofit_tiny_gen", "retrofit_tiny_rolling"):
        assert sub in header


def test_lm_eval_registry_loads_retrofit_model(converted_dir):
    """`--model retrofit` as lm-eval resolves it: registry name -> RetrofitLM over a converted checkpoint."""
    import retrofit.eval  # noqa: F401  (registers the model)
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    cls = get_model("retrofit")
    lm = cls.create_from_arg_string(f"pretrained={converted_dir}", {"batch_size": 2, "device": "cpu"})
    assert lm.retrofit_converted and lm.add_bos_token
    res = simple_evaluate(model=lm, tasks=["retrofit_tiny_mc"], limit=3, bootstrap_iters=0,
                          task_manager=harness.task_manager(["retrofit_tiny_mc"]))
    assert res["results"]["retrofit_tiny_mc"]["acc,none"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert get_model("hf").__name__ == "HFLM"  # registering ours keeps lm-eval's own models


def test_bad_include_path_is_a_clear_error(tmp_path):
    from retrofit.errors import RetrofitError

    with pytest.raises(RetrofitError, match="does not exist"):
        harness.task_manager(["retrofit_tiny_mc"], include_path=[tmp_path / "missing"])


def test_lm_eval_cli_adds_the_bundled_task_folder():
    assert with_task_folder(["run", "--model", "retrofit"], "/t")[-2:] == ["--include_path", "/t"]
    assert with_task_folder(["run", "--include_path", "/x"], "/t") == ["run", "--include_path", "/x"]
    assert with_task_folder([], "/t") == []
