"""Zero-shot baselines scored beside a model: the base with RoPE scaling or a RoPE cap, and a
converted model with its latent path closed.

A long-context result means something only beside what a user gets for free from the base
(design notes, section 10): transformers' RoPE scaling (``yarn:F``, ``dynamic:F``, ``linear:F``),
a ReRoPE-style distance cap (``cap:N``), and StreamingLLM (a converted model's frozen window and
sinks alone: ``closed``, the model's own ablation). ``retrofit eval ... --zero-shot yarn:4 cap:8191
closed`` adds one row per variant to the same table and plot.

    variants = parse_variants(["yarn:4", "closed"])
    roles = resolve_roles(model, tok, baseline, btok, variants=variants)   # {role: (model, tok, label)}

Roles are ordered as tables show them: ``baseline``, the baseline's variants, the model's
variants, ``model``. A variant's role name is its spec prefixed by whom it applies to
(``baseline:yarn:4``, ``model:closed``; ``model:yarn:4`` for an unconverted model scored without
a baseline: it is then the base).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrofit.errors import RetrofitError
from retrofit.eval import loading
from retrofit.eval.evaluators import MAX_COUNT

__all__ = ["KINDS", "Variant", "apply_variant", "copied_roles", "parse_variant", "parse_variants", "resolve_roles",
           "scoring_order", "takes_zero_shot", "variant_of"]

# kind -> (applies to, label template, takes a value)
KINDS: dict[str, tuple[str, str, bool]] = {
    "yarn": ("baseline", "{label} + YaRN x{value:g}", True),
    "dynamic": ("baseline", "{label} + dynamic NTK x{value:g}", True),
    "linear": ("baseline", "{label} + linear PI x{value:g}", True),
    "cap": ("baseline", "{label} + RoPE cap {value:d}", True),
    "closed": ("model", "{label}, latent path closed", False),
    # a bounded tier of exact tokens beside a Hedgehog layer's window and read (retrofit.layers.tier):
    # N tokens per KV head, chosen by the rule in the kind's name (tier: self-recall error)
    "tier": ("model", "{label} + exact tier {value:d} (recall)", True),
    "tier-norm": ("model", "{label} + exact tier {value:d} (key norm)", True),
    "tier-recency": ("model", "{label} + exact tier {value:d} (recency)", True),
    # block retrieval (unbounded): every settled block kept, each query reading its best N blocks exactly
    "retrieve": ("model", "{label} + retrieval of {value:d} blocks", True),
    "retrieve-bound": ("model", "{label} + retrieval of {value:d} blocks (Quest bound)", True),
}
_INT_KINDS = ("cap", "tier", "tier-norm", "tier-recency", "retrieve", "retrieve-bound")  # a number of tokens, not a factor


@dataclass(frozen=True)
class Variant:
    """One zero-shot variant: ``kind`` in :data:`KINDS` and its value (factor or cap)."""

    kind: str
    value: float | int | None = None

    @property
    def spec(self) -> str:
        """``kind:value``, parsed back to this variant exactly (role names are parsed again)."""
        if self.value is None:
            return self.kind
        short = f"{self.value:g}"  # 4.0 -> 4; a value :g would round (1000000 -> 1e+06) is written whole
        return f"{self.kind}:{short if float(short) == self.value and 'e' not in short else repr(self.value)}"

    @property
    def applies_to(self) -> str:
        """``baseline`` (RoPE variants of the base) or ``model`` (the converted model's ablation)."""
        return KINDS[self.kind][0]

    @property
    def role(self) -> str:
        return f"{self.applies_to}:{self.spec}"

    @property
    def length_dependent(self) -> bool:
        """Scores of a window depend on the window's length (dynamic NTK): no prefix reuse."""
        return self.kind == "dynamic"

    def label(self, base_label: str) -> str:
        return KINDS[self.kind][1].format(label=base_label, value=self.value)

    def same_as_base_up_to(self, base: Any) -> int:
        """The longest sequence (tokens, prompt and generated ones together) on which this variant of
        ``base`` computes what ``base`` itself does, by construction; 0 when none is.

        A RoPE cap N changes no distance below N + 1 tokens; dynamic NTK changes no frequency within
        the pretraining context (transformers rescales only past ``max_position_embeddings``). YaRN,
        linear interpolation and a closed latent path change every position.
        """
        if self.kind == "cap":
            from retrofit.surgery.rope_cap import capped_layers

            # a base already capped (--rope-cap) differs from this cap past the smaller of the two
            return min([int(self.value), *capped_layers(base).values()]) + 1
        if self.kind == "dynamic":
            config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
            return int(getattr(config, "max_position_embeddings", 0) or 0)
        return 0


def parse_variant(text: str) -> Variant:
    """``"yarn:4"`` -> ``Variant("yarn", 4.0)``; one ``RetrofitError`` line for anything else."""
    kind, _, raw = str(text).strip().partition(":")
    if kind not in KINDS:
        raise RetrofitError(f"unknown zero-shot variant {text!r}; use yarn:F, dynamic:F, linear:F (factor F > 1), "
                            f"cap:N (RoPE distance cap, N >= 1 tokens), closed (the latent path closed) or "
                            f"tier:N / tier-norm:N / tier-recency:N (an exact tier of N tokens per KV head) or retrieve:N "
                            f"(each query reads its best N stored blocks exactly)")
    takes_value = KINDS[kind][2]
    if not takes_value:
        if raw:
            raise RetrofitError(f"zero-shot variant {kind!r} takes no value, got {text!r}")
        return Variant(kind)
    try:
        value = int(raw) if kind in _INT_KINDS else float(raw)
    except ValueError:
        value = None
    tokens = kind in _INT_KINDS
    example = {"cap": 8191}.get(kind, 512 if tokens else 4)
    if value is not None and (value > MAX_COUNT if tokens else not math.isfinite(value)):
        need = f"at most {MAX_COUNT} tokens (more than any model reads)" if tokens else "a finite factor"
        raise RetrofitError(f"zero-shot variant {text!r}: {kind} needs {need}, e.g. {kind}:{example}")
    if value is None or (tokens and value < 1) or (not tokens and not value > 1.0):
        need = "an integer number of tokens >= 1" if tokens else "a factor > 1"
        raise RetrofitError(f"zero-shot variant {text!r}: {kind} needs {need}, e.g. {kind}:{example}")
    return Variant(kind, value)


def parse_variants(texts: list[str] | tuple[str, ...] | None) -> list[Variant]:
    """Parse and de-duplicate (first occurrence wins) a list of variant specs."""
    out: list[Variant] = []
    for text in texts or ():
        v = parse_variant(text)
        if v not in out:
            out.append(v)
    return out


def apply_variant(model: Any, variant: Variant) -> Any:
    """Apply ``variant`` to ``model`` in place (returns it). ``closed`` needs a model whose layers have a path to
    close (a window method's, LAVO's)."""
    if variant.kind in ("yarn", "dynamic", "linear"):
        from retrofit.surgery.rope_scaling import scale_rope

        scale_rope(model, variant.kind, float(variant.value))
    elif variant.kind == "cap":
        from retrofit.surgery.rope_cap import cap_rope

        if not cap_rope(model, int(variant.value)):
            raise RetrofitError(f"zero-shot variant {variant.spec!r}: the model has no full-attention layer to cap")
    elif variant.kind == "closed":
        layers = [m for m in model.modules() if hasattr(m, "latent_path_closed")]
        if not layers:
            raise RetrofitError("zero-shot variant 'closed' needs a converted model with a path beside the window "
                                "to close (Macchiato, delta, Hedgehog or LAVO); MODEL has no such layer")
        for m in layers:
            m.latent_path_closed = True
    elif variant.kind.startswith("tier") or variant.kind.startswith("retrieve"):
        from retrofit.layers.tier import set_tier

        if variant.kind.startswith("retrieve"):
            score = "bound" if variant.kind == "retrieve-bound" else "max"
            changed = set_tier(model, 0, retrieve=int(variant.value), retrieve_score=score)
        else:
            rule = {"tier": "recall", "tier-norm": "norm", "tier-recency": "recency"}[variant.kind]
            changed = set_tier(model, int(variant.value), rule)
        if not changed:
            raise RetrofitError(f"zero-shot variant {variant.spec!r} needs a converted Hedgehog model (the tier sits "
                                "beside its window and read); MODEL has no Hedgehog layer")
    return model


def _copy_of(source: Any, loaded: Any, *, device: str, dtype: str | None, rope_cap: int | None) -> Any:
    """A fresh model to mutate: loaded again from its path, or a deep copy of a loaded model."""
    if isinstance(source, (str, Path)):
        m, _ = loading.load_model(str(source), device=device, dtype=dtype)
        loading.apply_rope_cap(m, rope_cap)
        return m
    return copy.deepcopy(loaded)


def resolve_roles(
    model: Any,
    tokenizer: Any = None,
    baseline: Any = None,
    baseline_tokenizer: Any = None,
    *,
    variants: list[Variant] | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    rope_cap: int | None = None,
) -> dict[str, tuple[Any, Any, str]]:
    """``{role: (model, tokenizer, label)}`` for the model, its baseline and every variant, in table order.

    A baseline variant changes ``baseline`` (the base model it scales or caps), or, with no
    baseline, the model itself when it is unconverted (role ``model:yarn:4``); a converted model
    with no baseline is an error. Labels that collide get `` (baseline)`` appended to the
    baseline's. Every model is in eval mode on ``device``.
    """
    variants = list(variants or [])
    m, tok, m_label = loading.resolve(model, tokenizer, device=device, dtype=dtype, rope_cap=rope_cap)
    roles: dict[str, tuple[Any, Any, str]] = {}
    b = None
    if baseline is not None:
        b, btok, b_label = loading.resolve(baseline, baseline_tokenizer, device=device, dtype=dtype, rope_cap=rope_cap)
        loading.check_same_tokenizer(tok, btok, m_label, b_label)
        roles["baseline"] = (b, btok, b_label if b_label != m_label else f"{b_label} (baseline)")
    # without a baseline, an unconverted model is the base its RoPE variants change (role model:yarn:4)
    on_model = b is None and not loading.is_converted(m)
    for v in variants:
        if v.applies_to == "baseline" and b is None and not on_model:
            raise RetrofitError(f"zero-shot variant {v.spec!r} changes the base model, and MODEL is converted: "
                                "pass the base with --baseline BASE")
    ordered = [v for v in variants if v.applies_to == "baseline"] + [v for v in variants if v.applies_to == "model"]
    for v in ordered:
        if v.applies_to == "baseline" and not on_model:
            fresh = _copy_of(baseline, b, device=device, dtype=dtype, rope_cap=rope_cap)
            roles[v.role] = (apply_variant(fresh, v).eval(), roles["baseline"][1], v.label(roles["baseline"][2]))
        else:
            fresh = _copy_of(model, m, device=device, dtype=dtype, rope_cap=rope_cap)
            roles[f"model:{v.spec}"] = (apply_variant(fresh, v).eval(), tok, v.label(m_label))
    roles["model"] = (m, tok, m_label)
    return roles


def copied_roles(roles: dict[str, tuple[Any, Any, str]]) -> dict[str, tuple[str, int]]:
    """``{variant role: (source role, tokens)}`` for the roles of :func:`resolve_roles` that equal the
    model they change on sequences of at most ``tokens`` (:meth:`Variant.same_as_base_up_to`).

    An evaluator copies those sequences' results from the source role (scored first) instead of
    running them: the cells README and BENCHMARKS mark "= base". The source is ``baseline``, or
    ``model`` for an unconverted model scored without one (role ``model:cap:8191``).
    """
    out: dict[str, tuple[str, int]] = {}
    for role in roles:
        variant = variant_of(role)
        if variant is None or variant.applies_to != "baseline":
            continue
        source = "baseline" if "baseline" in roles else "model"
        tokens = variant.same_as_base_up_to(roles[source][0])
        if tokens > 0:
            out[role] = (source, tokens)
    return out


def scoring_order(roles: dict[str, Any]) -> list[str]:
    """The roles in the order to score them: every source of :func:`copied_roles` before its copies."""
    copied = copied_roles(roles)
    return sorted(roles, key=lambda role: role in copied)


def variant_of(role: str) -> Variant | None:
    """The variant a role name stands for (``baseline:yarn:4`` -> yarn 4), None for model/baseline."""
    head, _, spec = role.partition(":")
    return parse_variant(spec) if spec and head in ("baseline", "model") else None


def takes_zero_shot(runner: Any) -> bool:
    """Whether an evaluator's run function scores zero-shot variants (has a ``zero_shot`` parameter)."""
    import inspect

    return "zero_shot" in inspect.signature(runner).parameters
