"""Passkey prompts (exact length, needle depth), answer parsing, and a run through model.generate."""
from __future__ import annotations

import json

import pytest

from retrofit.errors import DataError
from retrofit.eval import passkey
from retrofit.eval.windows import encode
from retrofit.layers.cache import cache_keyword


@pytest.fixture(scope="module")
def filler(tokenizer):
    return passkey.haystack_tokens(tokenizer, "pg-books", need=2000)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_prompt_has_exact_length_and_needle_at_depth(tokenizer, filler, depth):
    L = 600
    ids, at = passkey.build_prompt(tokenizer, filler, L, depth, "48213", bos_id=tokenizer.bos_token_id)
    assert len(ids) == L and ids[0] == tokenizer.bos_token_id
    needle = encode(tokenizer, passkey.NEEDLE.format(key="48213"))
    assert ids[at : at + len(needle)] == needle
    intro, question = encode(tokenizer, passkey.INTRO), encode(tokenizer, passkey.QUESTION)
    budget = L - 1 - len(intro) - len(needle) - len(question)
    assert at - 1 - len(intro) == round(depth * budget)
    assert ids[-len(question):] == question
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text.count("48213") == 2 and text.rstrip().endswith("The pass key is")


def test_noise_haystack_is_the_classic_filler_around_the_needle(tokenizer):
    prompts = passkey.prompt_grid(tokenizer, [400], [0.5], trials=2, haystack="noise")
    for p in prompts:
        text = tokenizer.decode(p["ids"], skip_special_tokens=True)
        before, after = text.split(passkey.NEEDLE.format(key=p["key"]).strip())
        assert "The grass is green. The sky is blue." in before and "The sun is yellow." in after
        assert text.count(p["key"]) == 2 and len(p["ids"]) == 400
    assert prompts[0]["key"] != prompts[1]["key"]


def test_prompt_too_short_is_a_clear_error(tokenizer, filler):
    with pytest.raises(DataError, match="too short"):
        passkey.build_prompt(tokenizer, filler, 40, 0.5, "12345", bos_id=None)


def test_parse_answer():
    assert passkey.parse_answer(" 48213. Remember") == "48213"
    assert passkey.parse_answer(" is 4821") == "4821"
    assert passkey.parse_answer(" no digits") is None


def test_run_passkey_converted_vs_base(converted_dir, base_dir, tmp_path):
    res = passkey.run_passkey(str(converted_dir), baseline=str(base_dir), lengths=[256, 320], depths=[0.0, 1.0],
                              trials=2, out=tmp_path, progress=False)
    for name in ("results.json", "table.md", "passkey.png"):
        assert (tmp_path / name).is_file()
    data = json.loads((tmp_path / "results.json").read_text())
    for role in ("model", "baseline"):
        trials = data["results"][role]["trials"]
        assert len(trials) == 2 * 2 * 2
        for t in trials:
            assert t["correct"] == (t["answer"] == t["key"]) and len(t["key"]) == 5
        acc = data["results"][role]["accuracy"]
        assert set(acc) == {"256", "320"} and set(acc["256"]) == {"0", "1"}
        assert all(0.0 <= v <= 1.0 for row in acc.values() for v in row.values())
    # both models answered the very same prompts (same keys, same needle positions)
    strip = lambda ts: [(t["length"], t["depth"], t["key"], t["needle_at"]) for t in ts]  # noqa: E731
    assert strip(data["results"]["model"]["trials"]) == strip(data["results"]["baseline"]["trials"])
    assert "tiny-base + macchiato (2/2 layers, w 16, L 8), untrained" in res["table"] and "mean" in res["table"]


def test_a_cap_variant_takes_the_base_answers_where_it_is_the_base(converted_dir, base_dir):
    """cap:300: a 256-token prompt and its answer stay within 301 tokens, so the capped base is the base
    there (its answers copied, '= base' in the table); 320-token prompts are run."""
    res = passkey.run_passkey(str(converted_dir), baseline=str(base_dir), lengths=[256, 320], depths=[0.0, 1.0],
                              trials=2, zero_shot=["cap:300"], progress=False)
    base, capped = res["results"]["baseline"]["trials"], res["results"]["baseline:cap:300"]["trials"]
    for b, c in zip(base, capped):
        assert (c.get("same_as") == "baseline") == (c["length"] == 256)
        if c["length"] == 256:
            assert (c["answer"], c["output"], c["correct"]) == (b["answer"], b["output"], b["correct"])
    assert set(res["results"]["baseline:cap:300"]["seconds_per_length"]) == {"320"}
    row = next(line for line in res["table"].splitlines() if "RoPE cap 300" in line)
    assert row.split("|")[3].strip() == "= base" and row.split("|")[4].strip() != "= base"
    assert "'= base'" in res["description"]


@pytest.mark.parametrize("which", ["base", "converted", "capped"])
def test_chunked_prefill_generates_the_same_tokens(which, converted_dir, base_dir, tokenizer):
    """A prompt prefilled through the cache in chunks continues exactly as one prefill does:
    the plain KV cache, the converted model's state and a RoPE-capped full layer (cap well inside
    the prompt, so the capped scores matter)."""
    import torch

    from retrofit.surgery import cap_rope, load_any

    model, _ = load_any(str(converted_dir if which == "converted" else base_dir))
    if which == "capped":
        assert cap_rope(model, 40)
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (333,), generator=g).tolist()
    whole = passkey.generate_answer(model, tokenizer, ids, 12)
    for chunk in (64, 100):
        assert passkey.generate_answer(model, tokenizer, ids, 12, chunk_size=chunk) == whole
    assert passkey.generate_answer(model, tokenizer, ids[:50], 12, chunk_size=64) == \
        passkey.generate_answer(model, tokenizer, ids[:50], 12)
    # generate really continues from the prefilled cache: one filled from other tokens changes the answer
    other = torch.randint(3, len(tokenizer), (1, 332), generator=g)
    prompt = torch.tensor([ids])
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                         do_sample=False, pad_token_id=0,
                         **{cache_keyword(model.forward): passkey.prefill(model, other, 64)})
    assert tokenizer.decode(out[0, 333:], skip_special_tokens=True) != whole


def test_negative_prefill_chunk_is_a_clear_error_before_loading(tmp_path):
    with pytest.raises(DataError, match="prefill_chunk"):
        passkey.run_passkey(str(tmp_path / "no-such-model"), lengths=[256], prefill_chunk=-1, progress=False)


# ------------------------------------------------------------------ scores of models whose answers are known
def _passkey_score(model, tokenizer, tmp_path=None, **kw):
    res = passkey.run_passkey(model, tokenizer=tokenizer, lengths=[256, 320], depths=[0.0, 0.5, 1.0], trials=2,
                              prefill_chunk=0, progress=False, out=tmp_path, **kw)
    return res["results"]["model"]


def test_a_model_that_copies_the_key_scores_100(tokenizer, tmp_path):
    from .stubs import copier

    r = _passkey_score(copier(), tokenizer, tmp_path)
    assert r["mean_accuracy"] == 1.0
    assert all(v == 1.0 for row in r["accuracy"].values() for v in row.values())
    assert all(t["answer"] == t["key"] for t in r["trials"])
    assert "| 100 | 100 |" in (tmp_path / "table.md").read_text()


def test_a_model_that_never_finds_the_key_scores_0(tokenizer):
    from .stubs import says

    r = _passkey_score(says(tokenizer, " 7, I guess"), tokenizer)
    assert r["mean_accuracy"] == 0.0
    assert all(t["answer"] == "7" and t["correct"] is False for t in r["trials"])


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    return tok


def test_chat_template_prompt_is_exact_and_framed(chat_tokenizer, filler):
    from retrofit.eval import prompting

    frame = prompting.build_frame(chat_tokenizer, chat=True, bos_id=chat_tokenizer.bos_token_id)
    ids, at = passkey.build_prompt(chat_tokenizer, filler, 500, 0.5, "48213", bos_id=1, frame=frame)
    assert len(ids) == 500 and ids[: len(frame.head)] == frame.head and ids[0] == chat_tokenizer.bos_token_id
    text = chat_tokenizer.decode(ids, skip_special_tokens=True)
    assert text.startswith("<|user|>\nThere is an important")
    assert text.endswith("What is the pass key?<|end|>\n<|assistant|>\nThe pass key is")
    assert text.count("48213") == 2


@pytest.mark.parametrize("policy, used", [("auto", True), ("on", True), ("off", False)])
def test_chat_template_policy_is_recorded_and_the_copier_still_scores_100(chat_tokenizer, policy, used):
    from .stubs import copier

    res = passkey.run_passkey(copier(), tokenizer=chat_tokenizer, lengths=[256], depths=[0.0, 1.0], trials=1,
                              prefill_chunk=0, progress=False, chat_template=policy)
    assert res["settings"]["chat_template"] is used
    assert f"Chat template: {'on' if used else 'off'}" in res["description"]
    assert res["results"]["model"]["mean_accuracy"] == 1.0


def test_chat_template_on_without_a_template_is_a_clear_error(tokenizer):
    from .stubs import copier

    with pytest.raises(DataError, match="no chat template"):
        passkey.run_passkey(copier(), tokenizer=tokenizer, lengths=[256], depths=[0.0], trials=1,
                            progress=False, chat_template="on")
