"""A converted checkpoint's own identity in transformers: ``model_type`` ``retrofit_<base>``.

For every ``model_type`` of the family table (``patches/families.py``: ``llama``, ``qwen3``,
``phi3``, ``gemma3_text``, ...) this module defines

* ``Retrofit<Base>Config`` (e.g. ``RetrofitLlamaConfig``): the base config class with
  ``model_type = "retrofit_<base model_type>"``, so config.json says ``"retrofit_llama"``;
* ``Retrofit<Base>ForCausalLM`` (e.g. ``RetrofitLlamaForCausalLM``): the base causal-LM class
  whose ``__init__`` converts itself with the spec recorded in ``config.retrofit``, so
  ``from_pretrained`` builds the converted architecture and loads the new weights with the
  pretrained ones (no ``trust_remote_code``; the classes are ordinary subclasses).

:func:`register_auto_classes` adds them to ``AutoConfig`` / ``AutoModelForCausalLM`` (and PEFT's default
LoRA targets when PEFT is imported). ``import retrofit`` arranges that: immediately when
transformers is already imported, else right after transformers' own import (see
``retrofit/_hooks.py``), so ``import retrofit`` alone stays instant. Without retrofit,
transformers refuses the folder ("model type `retrofit_llama` ... does not recognize this
architecture"): a converted model never loads silently as its base.

``convert`` gives a converted model these classes in memory (:func:`adopt`), so even a plain
``model.save_pretrained`` writes the retrofit identity. The classes convert themselves through
the builder the package sets (:func:`set_builder`; ``retrofit.surgery.convert.build_from_record``).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from torch import nn

__all__ = [
    "PREFIX",
    "add_peft_target_modules",
    "adopt",
    "base_model_type",
    "config_class",
    "register_auto_classes",
    "retrofit_model_type",
    "set_builder",
]

PREFIX = "retrofit_"
_CONFIGS: dict[str, type] = {}  # base model_type -> Retrofit config class
_MODELS: dict[str, type] = {}  # base model_type -> Retrofit causal-LM class
_REGISTERED: set[str] = set()
# (model, config.retrofit) -> None: converts a freshly built base model to the recorded architecture.
# retrofit.surgery.convert.build_from_record, set by the package (retrofit/__init__.py) when transformers
# is imported: convert imports this module (it adopts its result into the classes below), so this
# module must not import convert back.
_BUILDER: Callable[[nn.Module, dict], None] | None = None
# generate() options that need to roll the decoding state back (impossible for a recurrent state)
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "assistant_tokenizer")


def set_builder(builder: Callable[[nn.Module, dict], None]) -> None:
    """What ``Retrofit*ForCausalLM.__init__`` runs to convert itself (``builder(model, record)``)."""
    global _BUILDER
    _BUILDER = builder


def retrofit_model_type(model_type: str) -> str:
    """``"llama"`` -> ``"retrofit_llama"`` (idempotent)."""
    return model_type if model_type.startswith(PREFIX) else PREFIX + model_type


def base_model_type(model_type: str | None) -> str | None:
    """``"retrofit_llama"`` -> ``"llama"``; other names unchanged."""
    if model_type and model_type.startswith(PREFIX):
        return model_type[len(PREFIX):]
    return model_type


class RetrofitCausalLMMixin:
    """Mixed in front of a family's ``*ForCausalLM``: builds the converted architecture in ``__init__``."""

    is_retrofit_model = True

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        record = getattr(config, "retrofit", None)
        if not isinstance(record, dict):
            raise ValueError(
                f"{type(self).__name__} needs config.retrofit (the conversion record); build converted models "
                "with retrofit.convert(base_model, spec) or load them from a converted folder"
            )
        if _BUILDER is None:
            raise RuntimeError(
                f"{type(self).__name__}: no conversion builder is set; import retrofit before transformers "
                "builds a converted model (retrofit registers it with transformers)"
            )
        _BUILDER(self, record)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.from_pretrained``; afterwards only the new weights are trainable, as after ``convert``."""
        from retrofit.surgery.converted import mark_new_trainable

        out = super().from_pretrained(*args, **kwargs)
        mark_new_trainable(out[0] if isinstance(out, tuple) else out)
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``GenerationMixin.generate``, refusing assisted / prompt-lookup decoding before it starts."""
        refuse_assisted_generation(kwargs, getattr(self, "generation_config", None))
        return super().generate(*args, **kwargs)


def refuse_assisted_generation(kwargs: dict, generation_config: Any = None) -> None:
    """ValueError when ``generate`` is asked for assisted / speculative / prompt-lookup decoding."""
    from retrofit.errors import RetrofitError

    gc = kwargs.get("generation_config") or generation_config
    asked = [k for k in _ASSISTED if kwargs.get(k) is not None]
    asked += [k for k in ("prompt_lookup_num_tokens", "assistant_early_exit")
              if k not in asked and getattr(gc, k, None) is not None]
    if asked:
        raise RetrofitError(
            f"a converted (retrofit) model cannot run assisted, speculative or prompt-lookup decoding "
            f"({', '.join(asked)}): its recurrent decoding state cannot roll back rejected draft tokens. "
            "Generate without these options."
        )


def _families() -> dict[str, tuple[type, type]]:
    """``{base model_type: (config class, causal-LM class)}`` for every family with a patch."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from retrofit.patches import supported_model_types

    out = {}
    for mt in supported_model_types():
        if mt not in CONFIG_MAPPING:
            continue
        cfg = CONFIG_MAPPING[mt]
        try:
            model = AutoModelForCausalLM._model_mapping[cfg]
        except KeyError:
            continue
        out[mt] = (cfg, model)
    return out


def _make_classes(mt: str, base_cfg: type, base_model: type) -> tuple[type, type]:
    module = sys.modules[__name__]
    cfg_name = f"Retrofit{base_cfg.__name__}"
    cfg_cls = type(cfg_name, (base_cfg,), {
        "model_type": retrofit_model_type(mt),
        "retrofit_base_model_type": mt,
        "__module__": __name__,
        "__qualname__": cfg_name,
        "__doc__": f"{base_cfg.__name__} of a retrofit-converted model (model_type {retrofit_model_type(mt)!r}).",
    })
    model_name = f"Retrofit{base_model.__name__}"
    model_cls = type(model_name, (RetrofitCausalLMMixin, base_model), {
        "config_class": cfg_cls,
        "__module__": __name__,
        "__qualname__": model_name,
        "__doc__": f"{base_model.__name__} converted by retrofit (the layers config.retrofit names).",
    })
    setattr(module, cfg_name, cfg_cls)  # importable by name: pickle / copy find them
    setattr(module, model_name, model_cls)
    return cfg_cls, model_cls


def register_auto_classes() -> list[str]:
    """Register ``retrofit_<family>`` with transformers' Auto classes (idempotent); returns the model types."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for mt, (base_cfg, base_model) in _families().items():
        if mt in _REGISTERED:
            continue
        cfg_cls, model_cls = _make_classes(mt, base_cfg, base_model)
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)
        # the name table pipelines and lm-eval consult ("is this a causal LM?")
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(cfg_cls.model_type, model_cls.__name__)
        _CONFIGS[mt], _MODELS[mt] = cfg_cls, model_cls
        _REGISTERED.add(mt)
    if "peft" in sys.modules:
        add_peft_target_modules()
    return [retrofit_model_type(mt) for mt in sorted(_REGISTERED)]


def add_peft_target_modules() -> None:
    """Give ``retrofit_<family>`` the default LoRA target modules of its base family."""
    try:
        from peft.utils import constants
    except ImportError:  # pragma: no cover - peft is optional
        return
    for name in dir(constants):
        table = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict):
            for mt in list(table):
                if not mt.startswith(PREFIX) and mt in _families_cache():
                    table.setdefault(retrofit_model_type(mt), table[mt])


def _families_cache() -> set[str]:
    from retrofit.patches import supported_model_types

    return set(supported_model_types())


def config_class(model_type: str) -> type | None:
    register_auto_classes()
    return _CONFIGS.get(base_model_type(model_type))


def adopt(model: nn.Module) -> nn.Module:
    """Give a freshly converted model the retrofit config / model classes (in place).

    Both are subclasses of the model's own classes with no extra state, so only the names
    (``model_type``, ``architectures``) change: ``save_pretrained`` then writes
    ``"model_type": "retrofit_<family>"``. A model of another class (a bare ``*Model``, a
    subclass) keeps its class; its config still takes the retrofit identity.
    """
    cfg = model.config
    mt = base_model_type(getattr(cfg, "model_type", None))
    cfg_cls = config_class(mt) if mt else None
    if cfg_cls is None:
        return model
    if type(cfg) is cfg_cls.__mro__[1]:
        cfg.__class__ = cfg_cls
    if type(cfg) is cfg_cls and "model_type" in vars(cfg):  # a config read from config.json keeps it per instance
        cfg.model_type = cfg_cls.model_type
    model_cls = _MODELS.get(mt)
    if model_cls is not None and type(model) is model_cls.__mro__[2]:
        model.__class__ = model_cls
    return model
