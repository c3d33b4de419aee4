"""Distillation objectives on tiny models: the attention and KL terms against independent references."""
from __future__ import annotations

import pytest
import torch

from retrofit.errors import SpecError
from retrofit.patches import get_patch
from retrofit.surgery import ConversionSpec, convert
from retrofit.surgery.distill import distill_mode, transfer_losses
from retrofit.train.objectives import Objective, objective_weights
from tests.surgery.tiny import FAMILIES, kl_divergence, tiny_model

T = 40


def _ids(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 256, (batch, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_loss_is_zero_when_latent_path_closed_and_window_covers_sequence(family):
    # natively windowed layers (Gemma 2/3, Qwen3 local layers) have a windowed teacher: convert the global ones
    base = tiny_model(family)
    windowed = any(get_patch(base).native_window(layer.self_attn) for layer in base.model.layers)
    model = convert(base, ConversionSpec(window=T, latents=8, init_swa_share=1.0, layers="global" if windowed else "all"))
    loss, parts = Objective({"attention": 1.0})(model, _ids())
    assert parts["attention"] < 1e-10, parts


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_mode_is_the_base_model(family):
    base = tiny_model(family)
    with torch.no_grad():
        ref = base(input_ids=_ids()).logits
    model = convert(tiny_model(family), ConversionSpec(window=8, latents=8))
    with torch.no_grad(), distill_mode(model, "teacher"):
        got = model(input_ids=_ids()).logits
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    with torch.no_grad():
        converted = model(input_ids=_ids()).logits
    assert (converted - ref).abs().max() > 1e-3  # the converted model itself differs


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_kl_is_zero_for_unconverted_pair_and_matches_dense_reference(family):
    layers = "global" if family in ("gemma2", "gemma3") else "all"
    model = convert(tiny_model(family), ConversionSpec(window=T, latents=8, init_swa_share=1.0, layers=layers))
    ids = _ids()
    _, parts = Objective({"kl": 1.0})(model, ids)
    assert parts["kl"] < 1e-6  # fp32 rounding of two identical forwards
    model = convert(tiny_model(family), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    obj = Objective({"kl": 1.0, "lm": 1.0}, logit_budget=256 * 7)  # slices of 3 positions x 2 rows
    _, parts = obj(model, ids)
    with torch.no_grad():
        student = model(input_ids=ids).logits
        with distill_mode(model, "teacher"):
            teacher = model(input_ids=ids).logits
        ce = torch.nn.functional.cross_entropy(student[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    assert parts["kl"] == pytest.approx(kl_divergence(teacher, student), rel=1e-4)
    assert parts["lm"] == pytest.approx(float(ce), rel=1e-5)


def _layers_by_hand(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Reference for the transfer term: ``[(student, teacher)]`` per layer, each converted layer run
    by hand on the unconverted (tiny llama) model's attention inputs, beside that model's output."""
    base = tiny_model("llama")
    captured = {}
    handles = [layer.self_attn.register_forward_hook(
        lambda m, a, kw, out, i=i: captured.__setitem__(i, (kw, out[0])), with_kwargs=True)
        for i, layer in enumerate(base.model.layers)]
    with torch.no_grad():
        base(input_ids=ids)
    for h in handles:
        h.remove()
    out = []
    for i, layer in enumerate(model.model.layers):
        kw, teacher = captured[i]
        kw = {k: v for k, v in kw.items() if k not in ("past_key_values", "cache")}  # the base's filled cache
        with torch.no_grad():
            student, _ = layer.self_attn.forward(**kw)
        out.append((student, teacher))
    return out


def test_attention_transfer_matches_per_layer_reference_and_trains_only_new_weights():
    model = convert(tiny_model("llama"), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    ids = _ids()
    loss, parts = Objective({"attention": 1.0})(model, ids)
    expected = sum(float(((student - teacher) ** 2).mean() / (teacher ** 2).mean())
                   for student, teacher in _layers_by_hand(model, ids))
    assert parts["attention"] == pytest.approx(expected, rel=1e-5)
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all("latent_" in n for n in grads), grads


def test_attention_transfer_ignores_padding():
    model = convert(tiny_model("gemma3"), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    ids = _ids(batch=1)
    with distill_mode(model, "transfer"):
        model(input_ids=ids)
        clean = [float(x.detach()) for x in transfer_losses(model)]
    pad = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(ids)], dim=1)
    with distill_mode(model, "transfer"):
        model(input_ids=pad, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
        padded = [float(x.detach()) for x in transfer_losses(model)]
    assert padded == pytest.approx(clean, rel=1e-4)


def test_objective_validation():
    assert objective_weights("lm") == {"lm": 1.0}
    assert objective_weights("mix", {"attention": 1, "kl": 0.5, "lm": 0}) == {"attention": 1.0, "kl": 0.5}
    for args in [("nope", None), ("mix", {}), ("mix", {"ce": 1}), ("mix", {"kl": -1}), ("kl", {"kl": 1}),
                 ("mix", {"kl": float("nan")})]:
        with pytest.raises(SpecError):
            objective_weights(*args)


def test_distill_mode_needs_converted_model():
    with pytest.raises(SpecError, match="no converted layers"):
        with distill_mode(tiny_model("llama"), "teacher"):
            pass


def test_head_positions_sample_matches_the_dense_terms_at_those_positions():
    """With train.head_positions the KL / CE are the dense per-token terms averaged over the sampled
    positions; the sample depends only on the tokens; a sample as large as T-1 is the full objective."""
    model = convert(tiny_model("llama"), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    ids = _ids()
    obj = Objective({"kl": 1.0, "lm": 1.0}, head_positions=7)
    idx = obj.sampled_positions(ids)
    assert idx.shape == (7,) and bool((idx[1:] > idx[:-1]).all()) and int(idx.max()) < T - 1
    assert torch.equal(idx, obj.sampled_positions(ids.clone()))  # resume draws the same positions
    assert not torch.equal(idx, obj.sampled_positions(_ids(seed=1)))
    _, parts = obj(model, ids)
    with torch.no_grad():
        student = model(input_ids=ids).logits
        with distill_mode(model, "teacher"):
            teacher = model(input_ids=ids).logits
    ce = torch.nn.functional.cross_entropy(student[:, idx].reshape(-1, 256), ids[:, idx + 1].reshape(-1))
    assert parts["kl"] == pytest.approx(kl_divergence(teacher[:, idx], student[:, idx]), rel=1e-4)
    assert parts["lm"] == pytest.approx(float(ce), rel=1e-5)
    loss, _ = obj(model, ids)
    loss.backward()  # gradients flow through the gathered positions to the new weights
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "latent" in n)
    full = Objective({"kl": 1.0})
    assert Objective({"kl": 1.0}, head_positions=T - 1).sampled_positions(ids) is None
    assert Objective({"kl": 1.0}, head_positions=T)(model, ids)[1] == pytest.approx(full(model, ids)[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_sliced_head_lm_is_the_models_own_loss_and_gradient(family):
    """``sliced_head``: the lm objective through slices of logits (a budget of 3 positions here)
    gives the model's own loss and the same gradients, Gemma 2's final soft-capping included."""
    model = convert(tiny_model(family), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    ids = _ids(seed=3)
    want = model(input_ids=ids, labels=ids).loss
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    vocab = model.get_output_embeddings().weight.shape[0]
    loss, parts = Objective({"lm": 1.0}, sliced_head=True, logit_budget=3 * vocab * ids.shape[0])(model, ids)
    loss.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-5) and parts["lm"] == pytest.approx(float(want), rel=1e-5)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want_grads.keys() and got
    for n, g in got.items():
        torch.testing.assert_close(g, want_grads[n], atol=1e-5, rtol=1e-4)


def test_head_positions_validation(tmp_path):
    from retrofit.train.recipe import load_recipe

    for bad in ("0", "-3", "2.5", "many"):
        with pytest.raises(SpecError, match="head_positions"):
            load_recipe("configs/gemma3-270m-hybrid-cpu.yaml", [f"train.head_positions={bad}"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("converted", [False, True])
def test_heldout_nll_is_the_models_own_loss(family, converted):
    """The training run's held-out loss without whole logits equals ``model(labels=...).loss``
    (Gemma 2's final soft-capping included), for base and converted models, and builds no graph."""
    from retrofit.train.objectives import heldout_nll

    model = tiny_model(family)
    if converted:
        model = convert(model, ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    ids = _ids(seed=5)
    with torch.no_grad():
        want = float(model(input_ids=ids, labels=ids).loss)
    gathered = []

    def gather(params):
        gathered.append(params)
        return torch.no_grad()

    total, n = heldout_nll(model, ids, gather=gather)
    assert n == ids.shape[0] * (T - 1)
    assert total / n == pytest.approx(want, rel=1e-5)
    assert gathered and gathered[0][0] is model.get_output_embeddings().weight


def test_heldout_nll_applies_a_final_softcap():
    """A soft-cap small enough to change the loss: the blockwise head must apply it as the model does."""
    from retrofit.train.objectives import heldout_nll

    model = tiny_model("gemma2", final_logit_softcapping=0.5)
    ids = _ids(seed=6)
    with torch.no_grad():
        want = float(model(input_ids=ids, labels=ids).loss)
        uncapped = torch.nn.functional.cross_entropy(
            model.lm_head(model.model(input_ids=ids).last_hidden_state)[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)
        )
    total, n = heldout_nll(model, ids)
    assert abs(float(uncapped) - want) > 1e-2  # the cap matters at this size
    assert total / n == pytest.approx(want, rel=1e-5)


def _lora_model(family: str = "llama", **spec):
    """A converted tiny model under PEFT LoRA on its attention projections, the adapters made non-zero."""
    from retrofit.surgery import new_parameter_names
    from retrofit.train.trainable import apply_trainable

    model = convert(tiny_model(family), ConversionSpec(**spec))
    model = apply_trainable(model, "lora", new_parameter_names(model),
                            lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def test_teacher_is_the_base_model_while_lora_trains_its_projections():
    ids = _ids()
    with torch.no_grad():
        ref = tiny_model("llama")(input_ids=ids).logits
    model = _lora_model(window=8, latents=8)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad(), distill_mode(model, "teacher"):
        teacher = model(input_ids=ids).logits
    torch.testing.assert_close(teacher, ref, atol=2e-5, rtol=2e-5)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags  # adapters' training state kept
    with torch.no_grad(), distill_mode(model, "teacher", layers=[0]):  # one layer: the adapted model around it
        partial = model(input_ids=ids).logits
    assert (partial - ref).abs().max() > 1e-2


def test_attention_transfer_hands_down_the_pretrained_attention_while_lora_trains():
    # each transfer layer passes its teacher downstream: with adapters bypassed for the teacher the
    # model's logits are the base's, and the student (adapted projections) still differs from it
    ids = _ids()
    with torch.no_grad():
        ref = tiny_model("llama")(input_ids=ids).logits
    model = _lora_model(window=T, latents=8, init_swa_share=1.0)
    with distill_mode(model, "transfer"):
        out = model(input_ids=ids).logits
        losses = transfer_losses(model)
    torch.testing.assert_close(out.detach(), ref, atol=2e-5, rtol=2e-5)
    assert min(float(x) for x in losses) > 1e-3  # LoRA moved the student, not the teacher
    assert any(p.grad is None for p in model.parameters())  # nothing stepped; grads flow only on backward
    sum(losses).backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    assert lora_grads and all(g is not None for g in lora_grads)


@pytest.mark.parametrize("mode", ["attention", "all"])
@pytest.mark.parametrize("objective", ["attention", "kl"])
def test_teacher_objectives_refuse_training_the_teachers_weights(mode, objective):
    from retrofit.train.recipe import recipe_from_dict

    data = {"model": {"name": "m"}, "trainable": {"mode": mode}, "train": {"objective": objective, "max_steps": 1}}
    with pytest.raises(SpecError, match="moving the teacher"):
        recipe_from_dict(data).validate()
    data["trainable"] = {"mode": "lora"}
    recipe_from_dict(data).validate()
    data["trainable"], data["train"]["objective"] = {"mode": mode}, "lm"
    recipe_from_dict(data).validate()


def test_layer_weights_scale_each_layers_transfer_loss():
    """train.layer_weights: the attention term is sum_i w_i * loss_i, w_i = 1 for layers not named;
    a zero weight removes a layer's gradient."""
    model = convert(tiny_model("llama"), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    ids = _ids()
    _, plain = Objective({"attention": 1.0})(model, ids)
    with torch.no_grad(), distill_mode(model, "transfer"):
        model(input_ids=ids, logits_to_keep=1)
        per_layer = [float(t) for t in transfer_losses(model)]
    assert len(per_layer) == 2 and plain["attention"] == pytest.approx(sum(per_layer), rel=1e-6)
    loss, parts = Objective({"attention": 1.0}, layer_weights={1: 3.0})(model, ids)
    assert parts["attention"] == pytest.approx(per_layer[0] + 3.0 * per_layer[1], rel=1e-6)
    model.zero_grad(set_to_none=True)
    Objective({"attention": 1.0}, layer_weights={0: 0.0})(model, ids)[0].backward()
    grads = {n.split(".")[2] for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == {"1"}  # model.layers.<i>...: only layer 1's new weights learn


def test_position_weights_weigh_each_positions_transfer_error_in_every_layer():
    """The attention term with position weights w (B, T) is, per layer,
    sum_t w_t |student_t - teacher_t|^2 / sum_t w_t |teacher_t|^2 (data.recall.answer_weight);
    all-ones weights are the unweighted loss, and the weights are gone after the block."""
    model = convert(tiny_model("llama"), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    ids = _ids()
    weights = torch.ones(ids.shape)
    weights[0, 30:33] = 50.0
    weights[1, 5] = 7.0
    with torch.no_grad(), distill_mode(model, "transfer", position_weights=weights):
        model(input_ids=ids, logits_to_keep=1)
        weighted = [float(t) for t in transfer_losses(model)]
    with torch.no_grad(), distill_mode(model, "transfer"):
        model(input_ids=ids, logits_to_keep=1)
        plain = [float(t) for t in transfer_losses(model)]
    pairs = _layers_by_hand(model, ids)

    def weighted_reference(w: torch.Tensor) -> list[float]:
        return [float(((s - t).pow(2).mean(-1) * w).sum() / (t.pow(2).mean(-1) * w).sum()) for s, t in pairs]

    expected = weighted_reference(weights)
    assert plain == pytest.approx(weighted_reference(torch.ones(ids.shape)), rel=1e-5)
    assert weighted == pytest.approx(expected, rel=1e-5)
    assert weighted != pytest.approx(plain, rel=1e-3)  # the weights matter
    mask = weights > 1
    _, ones = Objective({"attention": 1.0})(model, ids, answer_mask=mask)  # answer_weight 1: unweighted
    assert ones["attention"] == pytest.approx(sum(plain), rel=1e-6)
    weights[1, 5] = 50.0  # through the objective: answer_weight at every marked position
    _, through = Objective({"attention": 1.0}, answer_weight=50.0)(model, ids, answer_mask=mask)
    assert through["attention"] == pytest.approx(sum(weighted_reference(weights)), rel=1e-5)
    assert all(layer.self_attn.transfer_position_weights is None for layer in model.model.layers)  # reset on exit
    with pytest.raises(SpecError, match="position_weights weigh the transfer loss"):
        with distill_mode(model, "teacher", position_weights=weights):
            pass


@pytest.mark.parametrize("spec, match", [
    ({"all": 2.0}, "by index"),
    ({"0-1": -1.0}, ">= 0"),
    ({"0": "x"}, "must be a number"),
    ({"0": float("nan")}, ">= 0"),
    ({"0-1": 1.0, "1": 2.0}, "named twice"),
])
def test_layer_weights_errors(spec, match):
    from retrofit.train.objectives import layer_weights

    with pytest.raises(SpecError, match=match):
        layer_weights(spec)


def test_layer_weights_parse_ranges_and_lists():
    from retrofit.train.objectives import layer_weights

    assert layer_weights({"13-15": 4, "0,2": 0.5, 7: 1}) == {13: 4.0, 14: 4.0, 15: 4.0, 0: 0.5, 2: 0.5, 7: 1.0}
    assert layer_weights(None) == {}


def test_layer_weights_naming_an_unconverted_layer_is_refused_before_training(converted_dir, books, tmp_path):
    from retrofit.train import train
    from retrofit.train.recipe import recipe_from_dict
    from tests.train import tiny

    recipe = recipe_from_dict(tiny.recipe_dict(converted_dir, books, tmp_path / "out",
                                               train={"objective": "attention", "layer_weights": {"5-7": 2.0}}))
    with pytest.raises(SpecError, match=r"names layer\(s\) 5, 6, 7, which .* \(converted: 0-1\)"):
        train(recipe)
    assert not (tmp_path / "out" / "final").exists()


def test_the_trainer_hands_recall_answer_weights_to_the_attention_term(converted_dir, books, tmp_path, monkeypatch):
    """data.recall.answer_weight: every micro-batch reaches the objective with its (B, T) answer
    mask and the objective weighs those positions answer_weight times the others."""
    from retrofit.train import train
    from retrofit.train.recipe import recipe_from_dict
    from tests.train import tiny

    seen = []
    real = Objective.__call__

    def spy(self, model, input_ids, answer_mask=None):
        assert self.answer_weight == 20.0
        weights = None if answer_mask is None else 1.0 + 19.0 * answer_mask.float()
        seen.append((input_ids.clone(), weights))
        return real(self, model, input_ids, answer_mask=answer_mask)

    monkeypatch.setattr(Objective, "__call__", spy)
    recall = {"share": 1.0, "facts": 2, "min_distance": 50, "answer_weight": 20.0}
    recipe = recipe_from_dict(tiny.recipe_dict(converted_dir, books, tmp_path / "out",
                                               data={"seq_len": 512, "recall": recall},
                                               train={"objective": "attention", "max_steps": 2}))
    train(recipe)
    assert len(seen) == 2 * recipe.train.batch_size // recipe.train.micro_batch_size
    for ids, w in seen:
        assert w is not None and w.shape == ids.shape and w.dtype == torch.float32
        assert set(torch.unique(w).tolist()) == {1.0, 20.0}
        assert all(int((row == 20.0).sum()) >= 2 for row in w)  # at least one value token per fact, every row
    assert (tmp_path / "out" / "final").is_dir()


def test_recall_term_is_the_cross_entropy_of_the_marked_answers_only():
    """objective recall: mean next-token CE over the answer-mask positions, end to end through the
    converted model (no teacher); only the new weights learn; a batch without answers gives 0 with
    a graph; no mask is a SpecError; in mix it adds to the other terms on the same forward."""
    model = convert(tiny_model("llama"), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    ids = _ids()
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[0, 25:29] = True
    mask[1, 33:36] = True
    mask[1, T - 1] = True  # the last position has no next token: ignored
    loss, parts = Objective({"recall": 1.0})(model, ids, answer_mask=mask)
    with torch.no_grad():
        logp = model(input_ids=ids).logits.float().log_softmax(-1)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    expected = float(nll[mask[:, :-1]].mean())
    assert parts["recall"] == pytest.approx(expected, rel=1e-5) and set(parts) == {"recall"}
    assert abs(parts["recall"] - float(nll.mean())) > 1e-3  # not the plain LM loss
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all("latent_" in n for n in grads), grads
    empty, parts0 = Objective({"recall": 1.0})(model, ids, answer_mask=torch.zeros_like(mask))
    assert parts0["recall"] == 0.0 and empty.requires_grad
    with pytest.raises(SpecError, match="recall objective term needs the recall answers"):
        Objective({"recall": 1.0})(model, ids)
    _, both = Objective({"recall": 1.0, "lm": 0.5})(model, ids, answer_mask=mask)
    assert both["recall"] == pytest.approx(expected, rel=1e-5)
    assert both["lm"] == pytest.approx(float(nll.mean()), rel=1e-5)


def test_recall_objective_trains_through_the_trainer_and_needs_recall_facts(converted_dir, books, tmp_path):
    import json

    from retrofit.train import train
    from retrofit.train.recipe import recipe_from_dict
    from tests.train import tiny

    with pytest.raises(SpecError, match="recall term trains on recall answers, but data.recall.share is 0"):
        recipe_from_dict(tiny.recipe_dict(converted_dir, books, tmp_path / "x", train={"objective": "recall"}))
    recall = {"share": 1.0, "facts": 2, "min_distance": 50}
    recipe = recipe_from_dict(tiny.recipe_dict(converted_dir, books, tmp_path / "out", data={"seq_len": 512, "recall": recall},
                                               train={"objective": "mix", "objective_weights": {"recall": 1.0, "kl": 0.5},
                                                      "max_steps": 2}))
    train(recipe)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss_recall" in r]
    assert len(steps) == 2 and all(r["loss_recall"] > 0 and "loss_kl" in r for r in steps)
    assert (tmp_path / "out" / "final").is_dir()


def _hedgehog(**options):
    model = convert(tiny_model("llama"), ConversionSpec(method="hedgehog", window=6, features=8, sinks=1,
                                                        memory_distance=6, **options))
    with torch.no_grad():  # fitted-looking maps: queries and keys no longer share one map
        for layer in model.model.layers:
            layer.self_attn.feature_key.weight.add_(torch.randn_like(layer.self_attn.feature_key.weight), alpha=0.5)
    return model


def test_weights_term_is_the_layers_attention_weight_kl_summed():
    """objective weights: sum over layers of each layer's KL(softmax || its own weights) on the base's
    hidden states (the teacher's output flows downstream, so the logits are the base's); only the
    new weights get gradients; layer_weights and mix weigh it like the attention term."""
    model = _hedgehog()
    ids = _ids()
    with torch.no_grad(), distill_mode(model, "weights", queries=8) as modules:
        out = model(input_ids=ids).logits
        per_layer = [float(m.transfer_loss) for m in modules]
    with torch.no_grad(), distill_mode(model, "teacher"):
        base = model(input_ids=ids).logits
    torch.testing.assert_close(out, base)
    assert len(per_layer) == 2 and min(per_layer) > 0
    loss, parts = Objective({"weights": 1.0}, weights_queries=8)(model, ids)
    assert parts["weights"] == pytest.approx(sum(per_layer), rel=1e-5)
    _, parts = Objective({"weights": 1.0}, weights_queries=8, layer_weights={1: 3.0})(model, ids)
    assert parts["weights"] == pytest.approx(per_layer[0] + 3.0 * per_layer[1], rel=1e-5)
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n.split("self_attn.")[1].split(".")[0] for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {"feature_query", "feature_key", "memory_scale"}
    mixed, parts = Objective({"weights": 1.0, "attention": 0.5}, weights_queries=8)(model, ids)
    assert float(mixed) == pytest.approx(parts["weights"] + 0.5 * parts["attention"], rel=1e-5)


def test_weights_term_needs_a_method_with_attention_weights():
    from retrofit.train.recipe import recipe_from_dict

    macchiato = convert(tiny_model("llama"), ConversionSpec(window=6, latents=8, init_swa_share=0.5))
    with pytest.raises(SpecError, match="hedgehog.*method macchiato has none"):
        Objective({"weights": 1.0})(macchiato, _ids())
    data = {"model": {"name": "m"}, "conversion": {"method": "macchiato", "window": 8},
            "train": {"objective": "weights", "max_steps": 1}}
    with pytest.raises(SpecError, match="does not expose"):
        recipe_from_dict(data).validate()
    data["conversion"] = {"method": "hedgehog", "window": 8}
    recipe_from_dict(data).validate()
    data["train"]["weights_queries"] = 0
    with pytest.raises(SpecError, match="weights_queries"):
        recipe_from_dict(data).validate()


def test_the_trainer_fits_a_hedgehog_read_with_the_weights_term(books, tmp_path):
    """A recipe converting a base to hedgehog and training with objective weights: runs, logs the
    term, lowers it, and saves feature maps that moved."""
    import json

    from retrofit.train import train
    from retrofit.train.recipe import recipe_from_dict
    from tests.train import tiny

    base = tiny.save_base(tmp_path / "base")
    conversion = {"method": "hedgehog", "window": 8, "features": 8, "sinks": 1, "memory_distance": 8}
    recipe = recipe_from_dict(tiny.recipe_dict(base, books, tmp_path / "out", conversion=conversion,
                                               data={"seq_len": 64},
                                               train={"objective": "weights", "weights_queries": 16, "max_steps": 8,
                                                      "lr": 3e-2}))
    train(recipe)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss_weights"] for r in rows if r.get("kind") == "train"]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    from tests.methods._common import saved_weights

    saved = saved_weights(tmp_path / "out" / "final")
    keys = [k for k in saved if "feature_key" in k]
    assert keys and all(not torch.equal(saved[k], saved[k.replace("feature_key", "feature_query")]) for k in keys)
