"""retrofit: linear-time attention retrofits for pretrained LLMs.

Layers of the package (dependency arrows point one way):
``ops`` (pure tensor math) <- ``layers`` (modules holding new weights) <-
``patches`` / ``surgery`` (model families, conversion, checkpoints, cache) <-
``train`` / ``eval`` / ``cli``.

Importing retrofit registers the converted checkpoints' model types (``retrofit_llama``,
``retrofit_gemma3_text``, ...) with transformers' ``AutoConfig`` / ``AutoModelForCausalLM``
(and PEFT's LoRA defaults): at once if transformers is already imported, otherwise right after
its import, so ``import retrofit`` itself stays instant.
"""
from __future__ import annotations

from retrofit._version import __version__

__all__ = ["__version__", "convert", "load", "ConversionSpec"]


def __getattr__(name: str):  # lazy: importing retrofit must not import transformers
    if name in ("convert", "load", "ConversionSpec"):
        from retrofit import surgery

        return getattr(surgery, name)
    raise AttributeError(f"module 'retrofit' has no attribute {name!r}")


def _build_converted(model, record: dict) -> None:  # imported on first use: keeps transformers' import light
    from retrofit.surgery.convert import build_from_record

    build_from_record(model, record)


def _register_transformers() -> None:
    from retrofit.surgery.auto_classes import register_auto_classes, set_builder

    set_builder(_build_converted)
    register_auto_classes()


def _register_peft() -> None:
    import transformers  # noqa: F401  (runs the transformers registration first)

    from retrofit.surgery.auto_classes import add_peft_target_modules, register_auto_classes, set_builder

    set_builder(_build_converted)
    register_auto_classes()
    add_peft_target_modules()


from retrofit._hooks import when_imported  # noqa: E402

when_imported("transformers", _register_transformers)
when_imported("peft", _register_peft)
del when_imported
