"""When a sequence starts with BOS: one policy for training and evaluation.

* training (``data.bos_every_sequence``): every packed sequence starts with BOS when the
  tokenizer puts one in front of every text (:func:`sequence_bos`);
* evaluation (``--bos auto|always|never``): :func:`needs_bos`; ``auto`` also prepends BOS when
  the model's family needs it although its tokenizer does not say so (Gemma: quality collapses
  without BOS, and tokenizers rebuilt from GGUF do not always add it). Which families need it is
  a model fact, looked up above this tier and passed in as ``family_needs_bos``.
"""
from __future__ import annotations

from typing import Any

from retrofit.errors import RetrofitError

__all__ = ["BOS_POLICIES", "needs_bos", "sequence_bos", "tokenizer_adds_bos"]

BOS_POLICIES = ("auto", "always", "never")


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer has a BOS token and puts it in front of every text by itself."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True, verbose=False)["input_ids"]
    return bool(ids) and ids[0] == bos


def sequence_bos(tokenizer: Any) -> int | None:
    """The BOS id if the tokenizer puts one in front of every text (Gemma, Llama), else None (Qwen2, GPT-2)."""
    return int(tokenizer.bos_token_id) if tokenizer_adds_bos(tokenizer) else None


def needs_bos(tokenizer: Any, policy: str = "auto", *, family_needs_bos: bool = False) -> bool:
    """Whether to start every evaluated sequence with BOS.

    ``auto``: yes if the tokenizer adds BOS by itself or ``family_needs_bos``; and the tokenizer
    must have a BOS token. ``always`` / ``never`` force it (``always`` without a BOS token is an
    error).
    """
    if policy not in BOS_POLICIES:
        raise RetrofitError(f"BOS policy {policy!r} is not one of {', '.join(BOS_POLICIES)}")
    if policy == "never":
        return False
    if tokenizer.bos_token_id is None:
        if policy == "always":
            raise RetrofitError("--bos always, but the tokenizer has no BOS token")
        return False
    return policy == "always" or family_needs_bos or tokenizer_adds_bos(tokenizer)
