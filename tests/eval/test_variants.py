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


def test_dynamic_ntk_never_reuses_a_longer_window(sweep):
    short = sweep["results"]["pg-books-heldout"]["64"]
    assert "reused_windows" not in short["baseline:dynamic:4"]
    assert short["baseline"].get("reused_windows") == 1  # the others take window 0 from the 128-token pass


def test_baseline_variant_needs_a_baseline(converted_dir):
    with pytest.raises(RetrofitError, match="--baseline"):
        resolve_roles(str(converted_dir), variants=[Variant("yarn", 4.0)])
    with pytest.raises(RetrofitError, match="Macchiato"):
        base = tiny_llama(96)
        from retrofit.eval.variants import apply_variant

        apply_variant(base, Variant("closed"))


@pytest.mark.parametrize("argv, message", [
    (["--zero-shot", "yarn:4"], "pass it with --baseline BASE"),
    (["--zero-shot", "ntk:4"], "unknown zero-shot variant"),
])
def test_cli_errors_before_loading(converted_dir, tmp_path, capsys, argv, message):
    from retrofit.cli.main import main

    assert main(["eval", "ppl", str(converted_dir), "--out", str(tmp_path / "o"), *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("retrofit eval: error:") and message in err[0]
    assert not (tmp_path / "o").exists()
