"""Decoding engines beyond transformers' ``generate``: a compiled one-token step for converted models."""
from retrofit.decoding.compiled import (
    SUPPORTED_FAMILIES,
    CompiledDecoder,
    compiled_decoding_support,
    compiler_missing,
    cpu_compiler_available,
)

__all__ = ["CompiledDecoder", "SUPPORTED_FAMILIES", "compiled_decoding_support", "compiler_missing",
           "cpu_compiler_available"]
