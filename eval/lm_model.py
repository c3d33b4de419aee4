"""lm-eval model ``retrofit``: HFLM over a model loaded by :func:`retrofit.eval.loading.load_model`.

Accepts whatever ``retrofit.surgery.load_any`` accepts (a converted checkpoint folder, a base HF
folder or hub id, a GGUF file, ``gemma3-270m``), or an already-loaded model + tokenizer.
Loglikelihood requests run the model's ordinary forward; generation requests go through
``model.generate``, which for converted models is the constant-memory decoding path.

From the lm-eval CLI (lm-eval has no plugin entry points, so the module must be imported)::

    python -m retrofit.eval.lm_eval_cli run --model retrofit \\
        --model_args pretrained=runs/gemma-macchiato,dtype=float32 --tasks hellaswag
"""
from __future__ import annotations

import logging
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from retrofit.eval import loading


def resolve_device(device: str | None) -> str:
    """The device to load on: none given is CUDA where there is one, else the CPU; a CUDA device on a
    machine without CUDA (lm-eval's CLI passes ``cuda:0`` unless told otherwise) is the CPU, with a
    warning, as lm-eval's ``hf`` model does."""
    import torch

    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        logging.getLogger(__name__).warning("device %s: CUDA is not available, evaluating on the CPU "
                                            "(pass --device cpu to say so)", device)
        return "cpu"
    return str(device)


@register_model("retrofit")
class RetrofitLM(HFLM):
    """HFLM whose ``pretrained`` is loaded through retrofit (converted or base checkpoints)."""

    def __init__(
        self,
        pretrained: Any,
        tokenizer: Any = None,
        device: str | None = None,
        dtype: str | None = None,
        add_bos_token: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(pretrained, str):
            dtype = None if dtype in (None, "auto") else dtype
            model, tok = loading.load_model(pretrained, device=resolve_device(device), dtype=dtype)
            tokenizer = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else tok
        else:
            model = pretrained
            if tokenizer is None:
                raise ValueError("RetrofitLM: pass the tokenizer with an already-loaded model")
        if add_bos_token is None:
            add_bos_token = loading.needs_bos(model, tokenizer, "auto") or None
        for key in ("parallelize", "tp_plan"):  # meaningless for a pre-loaded model
            kwargs.pop(key, None)
        super().__init__(pretrained=model, tokenizer=tokenizer, add_bos_token=add_bos_token, **kwargs)
        self.retrofit_converted = loading.is_converted(model)
