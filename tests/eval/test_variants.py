"""Zero-shot baselines beside a model (--zero-shot): RoPE scaling through transformers' own
rope_parameters, the RoPE cap, and a converted model with its latent path closed."""
from __future__ import annotations

import copy
import math
import pytest
import torch

from retrofit.errors import RetrofitError, SpecError
from retrofit.eval import loading
from retrofit.eval.perplexity import run_perplexity
from retrofit.eval.variants import Variant, parse_variant, parse_variants, resolve_roles
from retrofit.surgery.rope_scaling import rope_scaling_of, scale_rope

from .tiny import tiny_gemma3, tiny_llama


@pytest.mark.parametrize("text, expected", [
    ("yarn:4", Variant("yarn", 4.0)), ("dynamic:2.5", Variant("dynamic", 2.5)), ("linear:8", Variant("linear", 8.0)),
    ("cap:8191", Variant("cap", 8191)), ("closed", Variant("closed")),
])
def test_parse(text, expected):
    v = parse_variant(text)
    assert v == expected and parse_variant(v.spec) == v


@pytest.mark.parametrize("text", ["yarn", "yarn:1", "yarn:x", "cap:0", "cap:2.5", "closed:1", "ntk:4", ""])
def test_parse_errors(text):
    with pytest.raises(RetrofitError):
        parse_variant(text)


def test_duplicates_keep_the_first():
    assert parse_variants(["yarn:4", "closed", "yarn:4.0"]) == [Variant("yarn", 4.0), Variant("closed")]


def _ids(vocab: int, T: int = 48) -> torch.Tensor:
    return torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "linear"])
def test_scale_rope_equals_a_model_built_with_that_rope(rope_type):
    """The scaled model is the model transformers builds from the scaled config, logit for logit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    base = tiny_llama(96, max_position_embeddings=16)  # 48 tokens: 3x past the context
    scaled = copy.deepcopy(base)
    assert scale_rope(scaled, rope_type, 4.0) == 1
    assert rope_scaling_of(scaled) == {"rope_type": rope_type, "factor": 4.0} and rope_scaling_of(base) is None
    params = {**base.config.rope_parameters, "rope_type": rope_type, "factor": 4.0}
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = 16
    cfg = LlamaConfig(**{**base.config.to_dict(), "rope_parameters": params})
    reference = LlamaForCausalLM(cfg).eval()
    reference.load_state_dict(base.state_dict())
    ids = _ids(96)
    with torch.no_grad():
        got, want, plain = scaled(ids).logits, reference(ids).logits, base(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(got, plain, atol=1e-4)  # it changed something


def test_scale_rope_on_gemma3_changes_only_the_global_layers():
    model = tiny_gemma3(96)
    before = {k: v.clone() for k, v in model.model.rotary_emb.named_buffers()}
    scale_rope(model, "yarn", 4.0)
    after = dict(model.model.rotary_emb.named_buffers())
    assert torch.equal(before["sliding_attention_inv_freq"], after["sliding_attention_inv_freq"])
    assert not torch.equal(before["full_attention_inv_freq"], after["full_attention_inv_freq"])
    assert model.config.rope_parameters["sliding_attention"].get("rope_type", "default") == "default"


def test_scale_rope_errors():
    model = tiny_llama(96)
    with pytest.raises(SpecError, match="one of"):
        scale_rope(model, "ntk", 4.0)
    with pytest.raises(SpecError, match="> 1"):
        scale_rope(model, "yarn", 1.0)
    scale_rope(model, "yarn", 2.0)
    with pytest.raises(SpecError, match="already"):
        scale_rope(model, "yarn", 2.0)


@pytest.fixture(scope="module")
def sweep(converted_dir, base_dir):
    res = run_perplexity(
        str(converted_dir), baseline=str(base_dir), datasets=["pg-books-heldout"], lengths=[64, 128], max_windows=1,
        zero_shot=["yarn:4", "dynamic:4", "cap:16", "closed"], progress=False,
    )
    return res


def test_every_variant_is_a_row_in_table_order(sweep):
    roles = list(sweep["models"])
    assert roles == ["baseline", "baseline:yarn:4", "baseline:dynamic:4", "baseline:cap:16", "model:closed", "model"]
    labels = [sweep["models"][r]["label"] for r in roles]
    assert labels[1:5] == ["tiny-base + YaRN x4", "tiny-base + dynamic NTK x4", "tiny-base + RoPE cap 16",
                           "tiny-base + macchiato (2/2 layers, w 16, L 8), untrained, latent path closed"]
    assert sweep["models"]["baseline:yarn:4"]["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0}
    assert sweep["models"]["model:closed"]["latent_path_closed"] is True
    assert sweep["models"]["model"]["latent_path_closed"] is False
    assert sweep["settings"]["zero_shot"] == ["yarn:4", "dynamic:4", "cap:16", "closed"]
    lines = sweep["table"].splitlines()
    assert lines[0].split("|")[1:4] == [" Dataset ", " Model ", " 64 "]
    assert len(lines) == 2 + 6  # header, rule, one row per model (one dataset)


def test_variant_numbers_are_those_of_the_variant_model(sweep, converted_dir, base_dir):
    cell = sweep["results"]["pg-books-heldout"]["128"]
    for role, variant in (("baseline:cap:16", "cap:16"), ("model:closed", "closed")):
        source = base_dir if role.startswith("baseline") else converted_dir
        model, tok = loading.load_model(str(source))
        from retrofit.eval.variants import apply_variant

        apply_variant(model, parse_variant(variant))
        alone = run_perplexity(model, tokenizer=tok, datasets=["pg-books-heldout"], lengths=[128], max_windows=1,
                               progress=False)
        assert cell[role]["ppl"] == pytest.approx(alone["results"]["pg-books-heldout"]["128"]["model"]["ppl"], rel=1e-5)
    for role, plain in (("baseline:cap:16", "baseline"), ("model:closed", "model")):  # each changed something
        assert abs(cell[role]["ppl"] / cell[plain]["ppl"] - 1) > 1e-6
    assert all(math.isfinite(e["ppl"]) for e in cell.values())


def test_dynamic_ntk_never_reuses_a_longer_window(tokenizer):
    base = tiny_llama(len(tokenizer), max_position_embeddings=32)  # both lengths past the context: both run
    res = run_perplexity(base, tokenizer=tokenizer, baseline=copy.deepcopy(base), baseline_tokenizer=tokenizer,
                         datasets=["pg-books-heldout"], lengths=[64, 128], max_windows=1, zero_shot=["dynamic:4"],
                         progress=False)
    short = res["results"]["pg-books-heldout"]["64"]
    assert "reused_windows" not in short["baseline:dynamic:4"] and "same_as" not in short["baseline:dynamic:4"]
    assert short["baseline"].get("reused_windows") == 1  # the others take window 0 from the 128-token pass


def test_the_sweep_copies_dynamic_ntk_inside_the_context(sweep):
    """The base's context is 4096: at 64 and 128 tokens dynamic NTK is the base, its cells copied."""
    for L in ("64", "128"):
        cell = sweep["results"]["pg-books-heldout"][L]
        assert cell["baseline:dynamic:4"]["same_as"] == "baseline"
        assert cell["baseline:dynamic:4"]["ppl"] == cell["baseline"]["ppl"]
        assert "same_as" not in cell["baseline:cap:16"] and "same_as" not in cell["baseline:yarn:4"]
    row = next(line for line in sweep["table"].splitlines() if "dynamic NTK" in line)
    assert row.count("= base") == 2
    assert "'= base'" in sweep["description"]


@pytest.mark.parametrize("model_kind", ["llama", "gemma3"])
def test_same_as_base_up_to_is_exact_at_its_bound(model_kind):
    """A RoPE cap N computes the base's logits on N + 1 tokens and not on N + 2; dynamic NTK the base's
    within the pretraining context and not one token past it. The bound is what lets an evaluator copy
    the base's cells, so it is checked at its edge, both ways."""
    from retrofit.eval.variants import apply_variant

    base = (tiny_llama(96, max_position_embeddings=24) if model_kind == "llama"
            else tiny_gemma3(96, max_position_embeddings=24, sliding_window=4))
    ids = _ids(96, 40)
    for spec in ("cap:11", "dynamic:4"):
        v = parse_variant(spec)
        variant = apply_variant(copy.deepcopy(base), v).eval()
        bound = v.same_as_base_up_to(base)
        assert bound == (12 if spec == "cap:11" else 24)
        with torch.no_grad():
            inside = variant(ids[:, :bound]).logits, base(ids[:, :bound]).logits
            past = variant(ids[:, :bound + 1]).logits, base(ids[:, :bound + 1]).logits
        torch.testing.assert_close(*inside, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(past[0][:, -1], past[1][:, -1], atol=1e-4), spec
    for spec in ("yarn:4", "linear:4", "closed"):
        assert parse_variant(spec).same_as_base_up_to(base) == 0


def test_a_cap_on_a_capped_base_is_bounded_by_the_smaller_cap():
    from retrofit.surgery.rope_cap import cap_rope

    base = tiny_llama(96)
    assert parse_variant("cap:100").same_as_base_up_to(base) == 101
    cap_rope(base, 40)
    assert parse_variant("cap:100").same_as_base_up_to(base) == 41
    assert parse_variant("cap:20").same_as_base_up_to(base) == 21


def test_a_variant_equal_to_the_base_is_not_run(tokenizer):
    """Lengths within the bound take the base's numbers and never call the variant's model; longer ones
    run it (and differ from the base)."""
    base = tiny_llama(len(tokenizer))
    called = set()

    def record(module, args, kwargs):  # windows only: a 16-token probe checks every model's head path
        if kwargs["input_ids"].shape[1] > 16:
            called.add(id(module))

    base.model.register_forward_pre_hook(record, with_kwargs=True)
    baseline = copy.deepcopy(base)  # the variant is a deep copy of this one, hook included
    res = run_perplexity(base, tokenizer=tokenizer, baseline=baseline, baseline_tokenizer=tokenizer,
                         datasets=["pg-books-heldout"], lengths=[48, 64], max_windows=1, zero_shot=["cap:47"],
                         progress=False, reuse_prefixes=False)
    assert len(called) == 3  # model, baseline and the capped copy: 64 tokens run the cap
    short, long = (res["results"]["pg-books-heldout"][L] for L in ("48", "64"))
    assert short["baseline:cap:47"] == {**{k: short["baseline"][k] for k in ("ppl", "nll_sum", "tokens", "windows",
                                                                              "window_ppl")}, "same_as": "baseline"}
    assert "same_as" not in long["baseline:cap:47"] and long["baseline:cap:47"]["ppl"] != long["baseline"]["ppl"]
    called.clear()
    res = run_perplexity(base, tokenizer=tokenizer, baseline=baseline, baseline_tokenizer=tokenizer,
                         datasets=["pg-books-heldout"], lengths=[48], max_windows=1, zero_shot=["cap:47"],
                         progress=False)
    assert len(called) == 2  # the model and the baseline only
    assert res["results"]["pg-books-heldout"]["48"]["baseline:cap:47"]["same_as"] == "baseline"


def _dynamic(base):
    model = copy.deepcopy(base)
    scale_rope(model, "dynamic", 4.0)
    return model


def test_dynamic_ntk_window_is_scored_as_the_window_alone():
    """A dynamic-NTK window scores the same chunked or not, and after a longer window as on a fresh model:
    unheld, chunks would rotate earlier keys with a shorter length's base, and transformers keeps the
    stretched frequencies of a longer sequence until one shorter than the context arrives (a window exactly
    as long as the context does not reset them)."""
    from retrofit.eval import nll
    from retrofit.surgery.rope_scaling import dynamic_rope_held_at, dynamic_rope_modules, reset_dynamic_rope

    base = tiny_llama(96, max_position_embeddings=16)
    ids = _ids(96, 64)
    with torch.no_grad():
        alone = nll.window_token_nll(_dynamic(base), ids)
        chunked_model = _dynamic(base)
        chunks = []
        chunked_model.model.register_forward_pre_hook(lambda m, a, kw: chunks.append(kw["input_ids"].shape[1]),
                                                      with_kwargs=True)
        chunked = nll.window_token_nll(chunked_model, ids, chunk_size=8)  # the first chunk is shorter than the context
        one_forward = _dynamic(base).model(ids).last_hidden_state
        unheld = torch.cat([out.last_hidden_state for _, out in nll.forward_chunks(_dynamic(base), ids, 8)], 1)
        held_model = _dynamic(base)
        with dynamic_rope_held_at(held_model, 64) as n_held:
            held = torch.cat([out.last_hidden_state for _, out in nll.forward_chunks(held_model, ids, 8)], 1)
        context_alone = nll.window_token_nll(_dynamic(base), ids[:, :16])
        model = _dynamic(base)
        nll.window_token_nll(model, ids)  # grows the frequencies to 64 positions
        context_after = nll.window_token_nll(model, ids[:, :16])
        nll.window_token_nll(model, ids)
        full_after = nll.window_token_nll_full(model, ids[:, :16])  # the full-logits path resets them too
    assert chunks == [8] * 8  # run in chunks, and scored as the one forward
    assert n_held == 1
    torch.testing.assert_close(held, one_forward, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unheld, one_forward, atol=1e-3)  # what holding the frequencies fixes
    torch.testing.assert_close(chunked, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_model.model.rotary_emb.inv_freq, _dynamic(base).model.rotary_emb.inv_freq,
                               rtol=0, atol=0)  # reset afterwards
    torch.testing.assert_close(context_after, context_alone, rtol=0, atol=0)
    torch.testing.assert_close(full_after, context_alone, rtol=1e-5, atol=1e-5)
    # what the reset undoes: without it, the 16-token window after the 64-token one scores otherwise
    model = _dynamic(base)
    with torch.no_grad():
        model(ids)
        stale = model(ids[:, :16]).logits
        reset_dynamic_rope(model)
        reset = model(ids[:, :16]).logits
        fresh = _dynamic(base)(ids[:, :16]).logits
    torch.testing.assert_close(reset, fresh, rtol=0, atol=0)
    assert not torch.allclose(stale, fresh, atol=1e-5)
    assert len(dynamic_rope_modules(model)) == 1 and dynamic_rope_modules(base) == [] and reset_dynamic_rope(base) == 0


def test_dynamic_ntk_per_layer_type_is_held_in_chunks():
    """Gemma 3 (one RoPE per layer type, dynamic only on the full-attention layers): chunks held at the
    window's length score as one forward, and the held module's per-type RoPE kinds come back unchanged."""
    from retrofit.eval import nll
    from retrofit.surgery.rope_scaling import dynamic_rope_held_at, dynamic_rope_modules

    model = tiny_gemma3(96, max_position_embeddings=16, sliding_window=64)
    scale_rope(model, "dynamic", 4.0)
    (rotary, layer_type), = dynamic_rope_modules(model)
    kinds = dict(rotary.rope_type)
    ids = _ids(96, 64)
    with torch.no_grad():
        alone = nll.window_token_nll(model, ids)
        chunked = nll.window_token_nll(model, ids, chunk_size=8)
        with dynamic_rope_held_at(model, 64):
            assert "dynamic" not in rotary.rope_type[layer_type]
            assert all(rotary.rope_type[lt] == kind for lt, kind in kinds.items() if lt != layer_type)
    torch.testing.assert_close(chunked, alone, rtol=1e-5, atol=1e-5)
    assert rotary.rope_type == kinds


def test_dynamic_ntk_prompt_prefills_as_one_forward():
    """generate_answer with a prefill chunk writes, for a dynamic-NTK model, what one forward of the prompt gives,
    with the prompt run in chunks."""
    from retrofit.eval.generation import generate_answer

    class Tok:
        pad_token_id, eos_token_id = 0, 2

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(int(i)) for i in ids)

    base = tiny_llama(96, max_position_embeddings=16)
    ids = _ids(96, 60)[0].tolist()
    reference = _dynamic(base)
    want = generate_answer(reference, Tok(), ids, 6)
    model = _dynamic(base)
    generate_answer(model, Tok(), _ids(96, 90)[0].tolist(), 2)  # a longer prompt first: frequencies grown
    seen = []
    model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    freqs = []
    def record(module, args, kwargs, out):  # calls over several positions: the prefill chunks
        positions = args[1] if len(args) > 1 else kwargs["position_ids"]
        if positions.shape[-1] > 1:
            freqs.append(module.inv_freq.clone())

    model.model.rotary_emb.register_forward_hook(record, with_kwargs=True)
    assert generate_answer(model, Tok(), ids, 6, chunk_size=8) == want  # a first chunk shorter than the context
    grown = _dynamic(base)
    grown.model(torch.tensor([ids]))  # one forward of the 60-token prompt
    assert len(freqs) == 8
    for f in freqs:  # every prefill chunk rotated with the whole prompt's frequencies
        torch.testing.assert_close(f, grown.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert seen[:8] == [8] * 7 + [3]  # 59 prompt tokens in chunks, then generate's own steps
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_baseline_variant_needs_a_baseline(converted_dir):
    with pytest.raises(RetrofitError, match="--baseline"):
        resolve_roles(str(converted_dir), variants=[Variant("yarn", 4.0)])
    with pytest.raises(RetrofitError, match="Macchiato"):
        base = tiny_llama(96)
        from retrofit.eval.variants import apply_variant

        apply_variant(base, Variant("closed"))


@pytest.mark.parametrize("argv, message", [
    (["--zero-shot", "yarn:4"], "MODEL is converted: pass the base with --baseline BASE"),
    (["--zero-shot", "ntk:4"], "unknown zero-shot variant"),
])
def test_cli_errors_before_loading(converted_dir, tmp_path, capsys, argv, message):
    from retrofit.cli.main import main

    assert main(["eval", "ppl", str(converted_dir), "--out", str(tmp_path / "o"), *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("retrofit eval ppl: error:") and message in err[0]
    assert not (tmp_path / "o").exists()


def test_rope_variants_of_an_unconverted_model_without_a_baseline(base_dir):
    """No --baseline and an unconverted MODEL: the RoPE variants change MODEL itself (it is the base)."""
    from retrofit.surgery.loading import names_converted

    roles = resolve_roles(str(base_dir), variants=[Variant("yarn", 4.0), Variant("cap", 16)])
    assert list(roles) == ["model:yarn:4", "model:cap:16", "model"]
    assert rope_scaling_of(roles["model:yarn:4"][0]) == {"rope_type": "yarn", "factor": 4.0}
    assert rope_scaling_of(roles["model"][0]) is None and rope_scaling_of(roles["model:cap:16"][0]) is None
    assert roles["model:yarn:4"][2] == roles["model"][2] + " + YaRN x4"
    res = run_perplexity(str(base_dir), datasets=["pg-books-heldout"], lengths=[64], max_windows=1, progress=False,
                         zero_shot=["yarn:4"])
    cell = res["results"]["pg-books-heldout"]["64"]
    assert set(cell) == {"model", "model:yarn:4"} and cell["model"]["ppl"] != cell["model:yarn:4"]["ppl"]
    assert names_converted(str(base_dir)) is False and names_converted("smollm2-135m") is False


def test_converted_model_names_itself_converted(converted_dir, tmp_path):
    from retrofit.surgery.loading import names_converted

    assert names_converted(str(converted_dir)) is True
    assert names_converted(str(tmp_path / "missing")) is None and names_converted("someone/some-model") is None
