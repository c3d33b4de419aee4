"""run_perplexity end to end on a converted tiny model beside its base, on pg-books, offline."""
from __future__ import annotations

import json
import math

import pytest
import torch

from retrofit.errors import DataError
from retrofit.eval import loading, nll
from retrofit.eval.perplexity import run_perplexity


@pytest.fixture(scope="module")
def sweep(converted_dir, base_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppl")
    res = run_perplexity(
        str(converted_dir), baseline=str(base_dir), datasets=["pg-books"], lengths=[64, 128],
        max_windows=2, chunk_size=48, out=out, progress=False,
    )
    return res, out


def test_files_and_table(sweep):
    res, out = sweep
    for name in ("results.json", "table.md", "perplexity.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["results"]["pg-books"]["64"]["model"]["ppl"] == pytest.approx(res["results"]["pg-books"]["64"]["model"]["ppl"])
    assert on_disk["models"]["model"]["converted"] and not on_disk["models"]["baseline"]["converted"]
    header = res["table"].splitlines()[0]
    assert "tiny-base 64" in header and "tiny-base + macchiato (2/2 layers, w 16, L 8), untrained 128" in header  # what it is, not its folder
    assert header.index("tiny-base 64") < header.index("+ macchiato")  # baseline first, as in Table 4
    assert (out / "perplexity.png").read_bytes()[:4] == b"\x89PNG"


def test_numbers_are_the_models_own_perplexity(sweep, converted_dir, base_dir):
    """Recompute one cell independently from the model's full logits on the recorded windows."""
    res, _ = sweep
    assert res["settings"]["bos_used"]
    wins = res["datasets"]["pg-books"]["windows"]["128"]
    assert len(wins) == 2 and wins[0]["doc"] != wins[1]["doc"]  # round-robin over books
    from retrofit.eval import corpora
    from retrofit.eval.windows import build_windows

    for role, folder in (("model", converted_dir), ("baseline", base_dir)):
        model, tok = loading.load_model(str(folder))
        spec = corpora.resolve_corpus("pg-books")
        windows = build_windows(corpora.iter_documents(spec), tok, [128], max_windows=2, bos_id=tok.bos_token_id)[128]
        assert [w.describe() for w in windows] == wins
        total = sum(nll.window_nll_full(model, w.input_ids)[0] for w in windows)
        entry = res["results"]["pg-books"]["128"][role]
        assert entry["tokens"] == 2 * 127
        assert entry["ppl"] == pytest.approx(math.exp(total / (2 * 127)), rel=1e-4)
        assert 1.0 < entry["ppl"] < 10 * len(tok)


def test_same_model_as_baseline_gives_identical_numbers(base_dir, tokenizer):
    model, tok = loading.load_model(str(base_dir))
    res = run_perplexity(model, tokenizer=tok, baseline=model, baseline_tokenizer=tok, datasets=["pg-books-heldout"],
                         lengths=[48], max_windows=2, progress=False)
    cell = res["results"]["pg-books-heldout"]["48"]
    assert cell["model"]["ppl"] == cell["baseline"]["ppl"]
    assert "(baseline)" in res["models"]["baseline"]["label"]


def test_documents_too_short_give_no_windows(base_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "short.txt").write_text("Only a few words here. " * 8)
    res = run_perplexity(str(base_dir), datasets=[str(data)], lengths=[16, 1024], progress=False, out=tmp_path / "o")
    assert res["results"]["data"]["1024"]["model"] == {"ppl": None, "windows": 0, "error": "no windows"}
    assert res["results"]["data"]["16"]["model"]["ppl"] is not None
    assert "no windows" in res["table"]
    # no window at any length: an error, not a table of empty cells
    with pytest.raises(DataError, match="nothing to score"):
        run_perplexity(str(base_dir), datasets=[str(data)], lengths=[1024], progress=False, out=tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_bos_policy(base_dir, tokenizer):
    from .tiny import tiny_gemma3

    model, tok = loading.load_model(str(base_dir))
    assert loading.needs_bos(model, tok, "auto")  # the tokenizer adds <bos> itself
    assert not loading.needs_bos(model, tok, "never")
    plain = type(tok).from_pretrained(str(base_dir))
    plain._tokenizer.post_processor = None  # a tokenizer that does not add BOS (e.g. rebuilt from GGUF)
    assert plain("a")["input_ids"][0] != plain.bos_token_id
    assert not loading.needs_bos(model, plain, "auto")
    assert loading.needs_bos(tiny_gemma3(len(tok)), plain, "auto")  # Gemma always gets BOS


def test_mismatched_tokenizers_are_refused(base_dir, tokenizer):
    from retrofit.errors import RetrofitError

    from .tiny import tiny_llama, train_tokenizer

    other = train_tokenizer(vocab_size=300)
    with pytest.raises(RetrofitError, match="tokenize text differently"):
        run_perplexity(str(base_dir), baseline=tiny_llama(len(other)), baseline_tokenizer=other,
                       datasets=["pg-books"], lengths=[32], max_windows=1, progress=False)


def test_uncapped_hub_stream_is_refused_before_any_download(base_dir):
    from retrofit.errors import DataError

    with pytest.raises(DataError, match="--max-windows"):
        run_perplexity(str(base_dir), datasets=["slimpajama"], lengths=[64], max_windows=None, progress=False)


def test_prefix_reuse_matches_separate_forwards(converted_dir, base_dir):
    """Window 0 of a book at 64 tokens is the start of window 0 at 128: reusing the longer forward's
    per-token NLLs gives the numbers that running each window alone gives (model and baseline)."""
    model, tok = loading.load_model(str(converted_dir))
    base, btok = loading.load_model(str(base_dir))
    kwargs = dict(tokenizer=tok, baseline=base, baseline_tokenizer=btok, datasets=["pg-books"],
                  lengths=[40, 64, 128], max_windows=2, chunk_size=48, progress=False)
    reused = run_perplexity(model, **kwargs)
    alone = run_perplexity(model, reuse_prefixes=False, **kwargs)
    for L in ("40", "64"):
        for role in ("model", "baseline"):
            a, b = reused["results"]["pg-books"][L][role], alone["results"]["pg-books"][L][role]
            assert a["reused_windows"] >= 1 and a["reused_from_lengths"] == [128]
            assert "reused_windows" not in b
            assert a["tokens"] == b["tokens"]
            assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-5)
    assert "reused_windows" not in reused["results"]["pg-books"]["128"]["model"]
    assert "takes its per-token NLLs" in reused["description"]


def test_prefix_reuse_checks_the_tokens():
    """A cached window is reused only when its tokens really begin the asked window."""
    from retrofit.eval.perplexity import PrefixCache
    from retrofit.eval.windows import Window

    cache = PrefixCache()
    long = Window("doc", 0, torch.arange(10))
    cache.store(long, torch.arange(9, dtype=torch.float64))
    per_token, source = cache.lookup(Window("doc", 0, torch.arange(4)))
    assert source == 10 and per_token.tolist() == [0.0, 1.0, 2.0]
    assert cache.lookup(Window("doc", 0, torch.tensor([0, 1, 5, 3]))) is None  # other tokens
    assert cache.lookup(Window("doc", 0, torch.arange(12))) is None  # longer than the cached one
    assert cache.lookup(Window("other", 0, torch.arange(4))) is None


def test_dtype_auto_follows_the_device(base_dir):
    from retrofit.errors import RetrofitError
    from retrofit.precision import auto_dtype_name

    model, _ = loading.load_model(str(base_dir), dtype="auto")
    assert str(next(model.parameters()).dtype) == f"torch.{auto_dtype_name('cpu')}"
    with pytest.raises(RetrofitError, match="not one of auto, float32"):
        loading.load_model(str(base_dir), dtype="float8")


def test_rope_cap_flag_caps_both_models_and_is_recorded(base_dir, tmp_path, capsys):
    """`retrofit eval ppl --rope-cap N`: both models' full-attention layers are capped (recorded in
    results.json), which changes windows longer than the cap; a bad value is one error line."""
    from retrofit.cli.main import main

    common = ["eval", "ppl", str(base_dir), "--baseline", str(base_dir), "--lengths", "64", "--datasets", "pg-books",
              "--max-windows", "1", "-q", "--json"]
    assert main(common + ["--out", str(tmp_path / "plain")]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(common + ["--out", str(tmp_path / "capped"), "--rope-cap", "8"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert plain["models"]["model"]["rope_cap"] is None
    layers = {str(i): 8 for i in range(loading.load_model(str(base_dir))[0].config.num_hidden_layers)}
    assert capped["models"]["model"]["rope_cap"] == capped["models"]["baseline"]["rope_cap"] == layers
    cell, plain_cell = capped["results"]["pg-books"]["64"], plain["results"]["pg-books"]["64"]
    assert cell["model"]["ppl"] == pytest.approx(cell["baseline"]["ppl"])
    assert abs(cell["model"]["ppl"] - plain_cell["model"]["ppl"]) > 1e-6 * plain_cell["model"]["ppl"]  # the cap acts
    assert main(common + ["--out", str(tmp_path / "bad"), "--rope-cap", "-1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "error: rope_cap must be a non-negative" in err[-1] and not (tmp_path / "bad").exists()


def test_dtype_casts_parameters_and_keeps_rope_frequencies(base_dir):
    """`--dtype bfloat16` casts the weights only: the rotary embedding's inv_freq stays fp32 (rounded
    to bf16 it would move every RoPE frequency by up to 0.4%, and the RoPE cap's re-rotation of the
    keys would no longer match the rotation they were given)."""
    model, _ = loading.load_model(str(base_dir), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    freqs = {name: b for name, b in model.named_buffers() if "inv_freq" in name}
    assert freqs and all(b.dtype == torch.float32 for b in freqs.values())
    fresh, _ = loading.load_model(str(base_dir))
    for name, b in freqs.items():
        torch.testing.assert_close(b, dict(fresh.named_buffers())[name], rtol=0, atol=0)
