"""A compiled one-token decoding step for a converted model whose every attention layer has one of
its own (:class:`retrofit.layers.decoding.CompiledDecodingLayer`).

Eager decoding runs each token through transformers' forward: per layer a dozen module calls,
the cache entry's Python bookkeeping and some forty small kernels, about a quarter of a CPU step
for SmolLM2-135M at any context (the rest is reading the weights). Here the whole step, embedding
to logits, is one function over fixed-shape buffers that ``torch.compile`` turns into one graph
(``fullgraph``: no Python between the layers), gpt-fast style.

This module is the generic driver: it takes over each layer's state after an eager prefill
(``layer.init_decoding_buffers(entry)``, fixed shapes: ring slots for the window, the method's
state), and per token runs the pretrained parts as the model's own modules (norms, q/k/v/o
through the family patch, the MLP, the rotary embedding) around each layer's
``layer.decoding_step(buffers, q, k, v, ...)``, which updates its buffers in place (an index
computed from the position tensor, so nothing in the graph changes from step to step: no
recompiles). What a step computes is the layer's business, written next to its eager step and
compared with it in the tests token by token (the window methods share the window's slots and
sinks: :class:`retrofit.layers.window.WindowDecodingBuffers`).

Supported: decoder layers of LLaMA shape (``input_layernorm -> attention ->
post_attention_layernorm -> mlp``: LLaMA, Mistral, Qwen2/3, Phi-3), every attention layer with a
compiled step it accepts (``layer.compiled_decoding_support()``), no soft-capping, a RoPE type with
fixed frequencies, prompts without padding. Anything else is refused with the reason (decode it
eagerly).
"""
from __future__ import annotations

import itertools
import types
from typing import Any

import torch
from torch import nn

from retrofit.errors import RetrofitError
from retrofit.layers.cache import cache_keyword, output_cache
from retrofit.layers.decoding import DecodingBuffers, supports_compiled_decoding
from retrofit.surgery.rope_scaling import dynamic_rope_modules

__all__ = ["CompiledDecoder", "SUPPORTED_FAMILIES", "compiled_decoding_support", "compiler_missing",
           "cpu_compiler_available"]

# families (patches/families.py) whose decoder layers are input_layernorm -> self_attn ->
# post_attention_layernorm -> mlp (pre-norm, plain residuals, unscaled embeddings, no logit soft-cap)
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

_DECODER_IDS = itertools.count()


def compiled_decoding_support(model: nn.Module) -> str | None:
    """None where :class:`CompiledDecoder` can run ``model``, else the reason it cannot."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "compiled decoding needs a causal LM with model.layers, model.rotary_emb and lm_head"
    if dynamic_rope_modules(model):
        return "compiled decoding needs fixed RoPE frequencies; dynamic NTK rescales them with the length"
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if not supports_compiled_decoding(attn):
            kind = type(attn).__name__
            return (f"layer {i} ({kind}) has no compiled decoding step (retrofit.layers.decoding.CompiledDecodingLayer); "
                    f"compiled decoding needs every attention layer converted to a method that has one")
        if attn.patch.family not in SUPPORTED_FAMILIES:
            return (f"compiled decoding supports the families {', '.join(SUPPORTED_FAMILIES)} (LLaMA-shaped decoder "
                    f"layers); this model is {attn.patch.family}")
        if attn.softcap:
            return "compiled decoding does not soft-cap attention logits"
        reason = attn.compiled_decoding_support()
        if reason is not None:
            return reason
        if attn.training or attn.distill_mode is not None:
            return "compiled decoding needs the model in eval mode, outside distillation"
    return None


def cpu_compiler_available() -> bool:
    """Whether inductor finds the C++ compiler it builds CPU kernels with (``g++``, ``clang++`` or ``$CXX``)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # noqa: BLE001 - inductor raises its own error types for a missing compiler
        return False
    return True


def compiler_missing(device: torch.device | str) -> str | None:
    """The reason ``torch.compile`` cannot build kernels for ``device`` here (a CPU without a C++
    compiler), else None."""
    if torch.device(device).type == "cpu" and not cpu_compiler_available():
        return "torch.compile builds CPU kernels with a C++ compiler and none was found (g++, clang++ or $CXX)"
    return None


class CompiledDecoder:
    """Decode a converted model one token per call through one compiled step.

    Args:
        model: a converted causal LM (every attention layer with a compiled step of its own; see
            :func:`compiled_decoding_support`), in eval mode.
        compile: compile the step with ``torch.compile(fullgraph=True)``; False runs the same
            step eagerly (the reference the tests compare the compiled one to).
        freeze_weights: compile with inductor's freezing: the weights become constants of the
            graph (on a CPU, prepacked matrix products and no per-call checks of the weights:
            SmolLM2-135M's fp32 step about 49 ms instead of 55-58 on a 2-core Zen 4), at the cost of a second copy of them in memory; a step after the weights
            changed raises instead of computing with the old ones.
        prefill_chunk: tokens per eager forward call in :meth:`prefill`.

    Example::

        >>> import torch, retrofit
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from retrofit.decoding import CompiledDecoder
        >>> base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
        >>> model = retrofit.convert(base, retrofit.ConversionSpec(method="macchiato", window=8, latents=8)).eval()
        >>> decoder = CompiledDecoder(model, compile=False)
        >>> logits = decoder.prefill(torch.randint(0, 64, (1, 12)))  # (B, vocab), the last prompt token's
        >>> logits = decoder.step(logits.argmax(-1, keepdim=True))  # one more token: (B, vocab)
        >>> logits.shape, decoder.position
        (torch.Size([1, 64]), 13)
    """

    def __init__(self, model: nn.Module, *, compile: bool = True, freeze_weights: bool = True, prefill_chunk: int = 1024):
        reason = compiled_decoding_support(model)
        if reason is not None:
            raise RetrofitError(reason)
        if prefill_chunk < 1:
            raise RetrofitError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        missing = compiler_missing(next(model.parameters()).device) if compile else None
        if missing is not None:
            raise RetrofitError(f"{missing}: install one, or decode without compiling")
        self.model = model
        self.layers = list(model.model.layers)
        self.prefill_chunk = int(prefill_chunk)
        self.buffers: list[DecodingBuffers] = []  # per layer, what its init_decoding_buffers returned
        self.position_tensor: torch.Tensor | None = None  # 0-dim long: the next token's stream index
        for layer in self.layers:
            _ = layer.self_attn.patch.rotary_fn  # resolved outside the traced step
        self.frozen = bool(compile and freeze_weights)
        self._weights_seen: tuple | None = None  # the weights a frozen step was compiled with
        self._params = list(model.parameters())
        if compile:
            # freezing: inductor treats the weights as constants (prepacked matmuls, no per-call guards
            # on ~10 tensors per layer); it keeps its own copy of them
            self._step = torch.compile(self._own_step_function(), fullgraph=True, dynamic=False)
        else:
            self._step = self._step_impl

    @property
    def position(self) -> int:
        """Tokens seen so far (the prompt and every decoded token)."""
        return 0 if self.position_tensor is None else int(self.position_tensor)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``input_ids`` ``(B, T)`` through the model (eager, with retrofit's cache)
        and take over its state. Returns the last prompt token's logits ``(B, vocab)``."""
        from transformers import DynamicCache

        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise RetrofitError(f"prefill takes input_ids of shape (batch, tokens >= 1), got {tuple(input_ids.shape)}")
        cache = DynamicCache(config=self.model.config)
        keyword = cache_keyword(self.model.forward)
        out = None
        for i in range(0, input_ids.shape[1], self.prefill_chunk):
            out = self.model(input_ids=input_ids[:, i : i + self.prefill_chunk], use_cache=True,
                             logits_to_keep=1, **{keyword: cache})  # every supported family takes it
            cache = output_cache(out)
        self.adopt(cache)
        return out.logits[:, -1].float()

    def adopt(self, cache: Any) -> None:
        """Take over the state of a retrofit cache after a prefill: each layer copies its entry into
        its fixed-shape buffers (``init_decoding_buffers``)."""
        entries = list(getattr(cache, "layers", []))
        if len(entries) != len(self.layers):
            raise RetrofitError(f"the cache has {len(entries)} layers, the model {len(self.layers)}")
        self.buffers = []
        position = None
        for layer, entry in zip(self.layers, entries):
            if not getattr(entry, "has_past", False):
                raise RetrofitError("compiled decoding continues a prefill: every layer needs its cache entry")
            if position is None:
                position = entry.cumulative_length
            self.buffers.append(layer.self_attn.init_decoding_buffers(entry))
        device = self.buffers[0].tensors()[0].device
        self.position_tensor = torch.tensor(position, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One token per row, ``input_ids`` ``(B, 1)``: returns its logits ``(B, vocab)`` and
        moves every layer's state one token on."""
        if self.position_tensor is None:
            raise RetrofitError("call prefill(prompt) before step()")
        if self.frozen:
            self._check_weights()
            from torch._inductor import config as inductor_config

            with inductor_config.patch(freezing=True):  # read when dynamo traces, not only by inductor
                logits = self._step(input_ids, self.position_tensor)
        else:
            logits = self._step(input_ids, self.position_tensor)
        self.position_tensor += 1
        return logits

    def _own_step_function(self):
        """``_step_impl`` bound to this decoder through its own code object. Dynamo keeps compiled
        graphs per code object and guards a frozen graph's weights by identity only, so a second
        decoder of the same model after an in-place weight change would otherwise reuse the first
        one's graph with the old weights baked in."""
        impl = CompiledDecoder._step_impl
        code = impl.__code__.replace(co_name=f"compiled_decoding_step_{next(_DECODER_IDS)}")
        return types.MethodType(types.FunctionType(code, impl.__globals__, code.co_name), self)

    def _weights_key(self) -> tuple:
        return tuple(p._version for p in self._params), tuple(p.data_ptr() for p in self._params)

    def _check_weights(self) -> None:
        """A frozen step computes with the weights it was compiled with: refuse to go on after a change."""
        key = self._weights_key()
        if self._weights_seen is None:
            self._weights_seen = key
        elif key != self._weights_seen:
            raise RetrofitError("the model's weights changed since this decoder compiled its step with them frozen; "
                                "build a new CompiledDecoder (or pass freeze_weights=False)")

    def _step_impl(self, input_ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        x = inner.embed_tokens(input_ids)  # (B, 1, hidden)
        position_ids = t.view(1, 1).expand(x.shape[0], 1)
        cos_sin = inner.rotary_emb(x, position_ids)
        for layer, buf in zip(self.layers, self.buffers):
            h = layer.input_layernorm(x)
            x = x + _attention_step(layer.self_attn, buf, h, cos_sin, t)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x))[:, -1].float()

    def memory_bytes(self) -> int:
        """Bytes of decoding state held by every layer's buffers (keys, values, sinks, the methods' states)."""
        return sum(b.nbytes() for b in self.buffers)


def _attention_step(attn: nn.Module, buf: DecodingBuffers, h: torch.Tensor, cos_sin: Any,
                    t: torch.Tensor) -> torch.Tensor:
    """One token through one attention layer's own step over its buffers: ``h (B, 1, hidden)`` ->
    ``(B, 1, hidden)``."""
    q, k, v = attn.patch.project_qkv(attn, h, cos_sin)  # (B, Hq|Hkv, 1, d)
    out = attn.decoding_step(buf, q, k, v, hidden_states=h, position_embeddings=cos_sin, position=t)
    return attn.patch.project_out(attn, out)
