"""Trainable sets: new / lora / attention / all (+ extra regexes) on a converted tiny model."""
from __future__ import annotations

import pytest

import retrofit
from retrofit.errors import SpecError
from retrofit.surgery import ConversionSpec, new_parameter_names
from retrofit.train.trainable import apply_trainable, count_parameters
from tests.train import tiny


def _converted(method="macchiato"):
    spec = ConversionSpec(**tiny.CONVERSION) if method == "macchiato" else ConversionSpec(method=method)
    return retrofit.convert(tiny.base_model(), spec)


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_new_attention_all_and_extra():
    model = _converted()
    new = new_parameter_names(model)
    assert new and all(("latent_q" in n or "latent_k" in n) for n in new)

    assert _trainable(apply_trainable(model, "new", new)) == set(new)
    counts = count_parameters(model)
    assert counts.trainable == sum(p.numel() for n, p in model.named_parameters() if n in new)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert "trainable parameters: 2,584 / 117,592" in str(counts)

    attention = _trainable(apply_trainable(model, "attention", new))
    assert set(new) < attention
    assert {n.rsplit(".", 2)[-2] for n in attention - set(new)} == {"q_proj", "k_proj", "v_proj", "o_proj"}

    assert _trainable(apply_trainable(model, "all", new)) == {n for n, _ in model.named_parameters()}
    extra = _trainable(apply_trainable(model, "new", new, extra=[r"\.input_layernorm\."]))
    assert extra - set(new) == {f"model.layers.{i}.input_layernorm.weight" for i in range(2)}


def test_lora_adapters_plus_new_weights():
    model = _converted()
    new = new_parameter_names(model)
    peft_model = apply_trainable(model, "lora", new, lora={"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    trainable = _trainable(peft_model)
    lora = {n for n in trainable if "lora_" in n}
    assert lora and all((".q_proj." in n or ".v_proj." in n) for n in lora)
    # the new weights train as PEFT modules_to_save copies (saved in the adapter); their originals stay frozen
    assert {n.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".")
            for n in trainable - lora} == set(new)
    assert peft_model.peft_config["default"].modules_to_save == ["latent_k", "latent_q"]
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if n.endswith("q_proj.base_layer.weight"))
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if ".original_module." in n)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_lora_targets_default_to_the_family_table(family):
    """No target_modules in the recipe: the family row's (Phi-3: fused qkv_proj / gate_up_proj)."""
    from retrofit.train.recipe import LoraSection
    from tests.surgery.tiny import tiny_model

    assert LoraSection().target_modules is None
    model = retrofit.convert(tiny_model(family), ConversionSpec(window=8, latents=8))
    peft_model = apply_trainable(model, "lora", new_parameter_names(model), lora={"r": 2, "target_modules": None})
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in _trainable(peft_model) if ".lora_" in n}
    want = {"phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, "llama": {"q_proj", "k_proj", "v_proj", "o_proj"}}
    assert adapted == want[family]


def test_any_lora_config_field_passes_through_from_the_recipe():
    from retrofit.train.recipe import recipe_from_dict

    recipe = recipe_from_dict({"model": {"name": "x"}, "trainable": {"mode": "lora", "lora": {
        "r": 2, "target_modules": ["q_proj"], "use_dora": True, "modules_to_save": ["lm_head"], "lora_bias": False}}})
    lora = recipe.trainable.lora
    assert lora.peft == {"use_dora": True, "modules_to_save": ["lm_head"], "lora_bias": False}
    model = _converted()
    peft_model = apply_trainable(model, "lora", new_parameter_names(model), lora=__import__("dataclasses").asdict(lora))
    cfg = peft_model.peft_config["default"]
    assert cfg.use_dora and cfg.modules_to_save == ["latent_k", "latent_q", "lm_head"]
    assert any("lora_magnitude_vector" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    with pytest.raises(SpecError, match="use_dorra is not a peft.LoraConfig field"):
        apply_trainable(_converted(), "lora", [], lora={"target_modules": ["q_proj"], "peft": {"use_dorra": True}})


def test_get_peft_model_with_the_documented_modules_to_save():
    """The one-line fix for users of get_peft_model: modules_to_save=retrofit.surgery.new_module_names(model)."""
    from peft import LoraConfig, get_peft_model

    from retrofit.surgery import new_module_names

    model = _converted()
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"],
                                                  modules_to_save=new_module_names(model)))
    trainable = _trainable(peft_model)
    assert any("latent_q.modules_to_save" in n for n in trainable)
    assert any("latent_k.modules_to_save" in n for n in trainable)


def test_clear_errors():
    exp = _converted("exp-linear")
    assert new_parameter_names(exp) == []
    with pytest.raises(SpecError, match="selects no parameters.*lora, attention or all"):
        apply_trainable(exp, "new", [])
    assert _trainable(apply_trainable(exp, "attention", []))
    model = _converted()
    with pytest.raises(SpecError, match="no module named 'query'.*q_proj"):
        apply_trainable(model, "lora", new_parameter_names(model), lora={"target_modules": ["query"]})
    with pytest.raises(SpecError, match="not a valid regex"):
        apply_trainable(model, "new", [], extra=["(unclosed"])


def test_peft_knows_the_retrofit_model_types():
    """PEFT's default LoRA targets apply to retrofit_<family> as to its base family."""
    from peft import LoraConfig, get_peft_model

    model = _converted()
    assert model.config.model_type.startswith("retrofit_")
    peft_model = get_peft_model(model, LoraConfig(r=2))  # no target_modules: PEFT's table for the family
    assert set(peft_model.peft_config["default"].target_modules) >= {"q_proj", "v_proj"}
