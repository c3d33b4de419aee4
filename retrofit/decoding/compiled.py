"""A compiled one-token decoding step for a model whose every attention layer is Macchiato (or the
delta or hedgehog method: the same window branch, :mod:`retrofit.layers.window`, with a delta-rule
memory or a Hedgehog read beyond it).

Eager decoding runs each token through transformers' forward: per layer a dozen module calls,
the cache entry's Python bookkeeping and some forty small kernels, about a quarter of a CPU step
for SmolLM2-135M at any context (the rest is reading the weights). Here the whole step, embedding
to logits, is one function over fixed-shape buffers that ``torch.compile`` turns into one graph
(``fullgraph``: no Python between the layers), gpt-fast style:

* per layer ``[n sink slots | w ring slots]`` of keys and values: the token at stream index ``s``
  lives in ring slot ``s % w``, so a step writes its key and value with ``index_copy_`` at an
  index computed from the position tensor, and nothing in the graph changes from step to step
  (no recompiles);
* which slots a query sees is computed from the position too: ring slot ``j`` once a token has
  reached it (``j <= t``), a sink once it lies before the window (``idx <= t - w``), with its
  key re-positioned to the capped RoPE distance (:func:`retrofit.ops.capped_sink_keys`);
* the layer's own mixing logits and :func:`retrofit.ops.macchiato_slot_step` (the eager slot
  step's arithmetic), the latent state ``m (B, H, L, D)``, ``z (B, H, L)`` copied back in place;
  for the delta method, :func:`retrofit.ops.delta_rule_step` on the memory ``S (B, H, d, D)``, also
  copied back in place; for the hedgehog method the window's log-sum-exp, the layer's
  :meth:`~retrofit.layers.hedgehog.HedgehogAttention.memory_step` on the read's state ``S (B, H, F, D)``,
  ``z (B, H, F)`` (copied back in place), the key it takes read from ring slot ``(t + 1) % w``.

The pretrained parts run as the model's own modules (norms, q/k/v/o through the family patch,
the MLP, the rotary embedding), so the step is the eager step's arithmetic, compared in the
tests token by token. Supported: decoder layers of LLaMA shape (``input_layernorm -> attention
-> post_attention_layernorm -> mlp``: LLaMA, Mistral, Qwen2/3, Phi-3), every layer Macchiato, delta or hedgehog,
no soft-capping, a RoPE type with fixed frequencies, prompts without padding. Anything else is
refused with the reason (decode it eagerly).
"""
from __future__ import annotations

import itertools
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retrofit.errors import RetrofitError
from retrofit.layers.cache import cache_keyword, output_cache
from retrofit.layers.delta import DeltaAttention
from retrofit.layers.hedgehog import HedgehogAttention
from retrofit.layers.macchiato import MacchiatoAttention
from retrofit.layers.window import WindowAttention, WindowLayerCache
from retrofit.ops import DeltaState, LatteState, capped_sink_keys, macchiato_slot_step, slot_attention_step
# the torch kernel itself, not the dispatched op: the backend registry's lookups stay out of the traced step
from retrofit.ops.delta_rule import delta_rule_step
from retrofit.ops.hedgehog import HedgehogState
from retrofit.surgery.rope_scaling import dynamic_rope_modules

__all__ = ["CompiledDecoder", "SUPPORTED_FAMILIES", "compiled_decoding_support", "compiler_missing",
           "cpu_compiler_available"]

# families (patches/families.py) whose decoder layers are input_layernorm -> self_attn ->
# post_attention_layernorm -> mlp (pre-norm, plain residuals, unscaled embeddings, no logit soft-cap)
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# the window methods whose step this module writes (another WindowAttention subclass is decoded eagerly)
SUPPORTED_LAYERS = (MacchiatoAttention, DeltaAttention, HedgehogAttention)

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
        if not isinstance(attn, SUPPORTED_LAYERS):
            kind = type(attn).__name__
            return (f"compiled decoding needs every attention layer converted to Macchiato, delta or hedgehog; layer {i} "
                    f"is {kind}")
        if attn.patch.family not in SUPPORTED_FAMILIES:
            return (f"compiled decoding supports the families {', '.join(SUPPORTED_FAMILIES)} (LLaMA-shaped decoder "
                    f"layers); this model is {attn.patch.family}")
        if attn.softcap:
            return "compiled decoding does not soft-cap attention logits"
        if getattr(attn, "tier", 0) or getattr(attn, "retrieve", 0):
            return "compiled decoding has no step for an exact tier or block retrieval; decode eagerly"
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


@dataclass
class _LayerBuffers:
    """One layer's decoding state in fixed shapes (see the module docstring)."""

    slot_k: torch.Tensor  # (B, Hkv, n + w, d)
    slot_v: torch.Tensor  # (B, Hkv, n + w, D)
    sink_k: torch.Tensor  # (B, Hkv, n, d): the sinks' keys at their own positions (capped per step)
    sink_idx: torch.Tensor  # (B, n) stream positions of the sinks
    sink_ok: torch.Tensor  # (B, n) bool: a real sink
    m: torch.Tensor | None  # (B, H, L, D) latent value means, or None without latent states
    z: torch.Tensor | None  # (B, H, L) log-normalisers
    memory: torch.Tensor | None  # (B, H, d, D) the delta-rule memory (fp32 at least), or None: not a delta layer
    read_S: torch.Tensor | None  # (B, H, F, D) the Hedgehog read's state (fp32 at least), or None: not a hedgehog layer
    read_z: torch.Tensor | None  # (B, H, F) its normaliser
    conv_tail: torch.Tensor | None  # (B, conv_size - 1, hidden)


class CompiledDecoder:
    """Decode a converted model one token per call through one compiled step.

    Args:
        model: a converted causal LM (every attention layer Macchiato, delta or hedgehog; see
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
        self.buffers: list[_LayerBuffers] = []
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
        """Take over the state of a retrofit cache after a prefill (chronological window layout)."""
        entries = list(getattr(cache, "layers", []))
        if len(entries) != len(self.layers):
            raise RetrofitError(f"the cache has {len(entries)} layers, the model {len(self.layers)}")
        self.buffers = []
        position = None
        for layer, entry in zip(self.layers, entries):
            if not isinstance(entry, WindowLayerCache) or not entry.has_past:
                raise RetrofitError("compiled decoding continues a prefill: every layer needs its window cache entry")
            if position is None:
                position = entry.cumulative_length
            self.buffers.append(_adopt_layer(layer.self_attn, entry))
        device = self.buffers[0].slot_k.device
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
        """Bytes of decoding state held (keys, values, sinks, latent states, delta memories, conv tails)."""
        return sum(t.numel() * t.element_size() for b in self.buffers
                   for t in vars(b).values() if isinstance(t, torch.Tensor))


def _adopt_layer(attn: WindowAttention, entry: WindowLayerCache) -> _LayerBuffers:
    keys, values, valid = entry.past_kv()  # chronological: the last min(seen, w - 1) tokens
    if valid is not None and not bool(valid.all()):
        raise RetrofitError("compiled decoding takes prompts without padding; decode padded batches eagerly")
    seen, w = entry.cumulative_length, attn.window
    B, Hkv, P, d = keys.shape
    n = attn.sinks
    if n:
        if entry.sinks is None or not entry.sinks_full:
            raise RetrofitError(f"the prompt is shorter than the layer's {n} attention sinks; decode it eagerly")
        sink_idx, sink_ok, sink_k, sink_v = entry.sinks
    else:
        sink_idx = torch.zeros(B, 0, dtype=torch.long, device=keys.device)
        sink_ok = torch.zeros(B, 0, dtype=torch.bool, device=keys.device)
        sink_k, sink_v = keys[:, :, :0], values[:, :, :0]
    slot_k = keys.new_zeros(B, Hkv, n + w, d)
    slot_v = values.new_zeros(B, Hkv, n + w, values.shape[-1])
    slot_k[:, :, :n], slot_v[:, :, :n] = sink_k, sink_v
    ring = n + torch.arange(seen - P, seen, device=keys.device) % w  # token s sits in ring slot s % w
    slot_k[:, :, ring], slot_v[:, :, ring] = keys, values
    state = entry.state
    m = z = None
    if isinstance(attn, MacchiatoAttention) and attn.latent_k is not None:
        if state is None:
            state = LatteState.empty(B, attn.num_heads, attn.latents_per_head, values.shape[-1], device=keys.device)
        m, z = state.m.clone(), state.z.clone()
    memory = None
    if isinstance(attn, DeltaAttention):  # closed during the prefill: nothing written yet
        memory = state.memory.clone() if isinstance(state, DeltaState) else torch.zeros(
            B, attn.num_heads, d, values.shape[-1], dtype=torch.promote_types(values.dtype, torch.float32),
            device=keys.device)
    read_S = read_z = None
    if isinstance(attn, HedgehogAttention):
        if state is None and not attn.latent_path_closed:
            raise RetrofitError("the prompt was run with the Hedgehog read closed, so the cache holds no memory of its "
                                "keys: prefill again with the read open")
        F = 2 * attn.features
        read_S = state.S.clone() if state is not None else torch.zeros(
            B, attn.num_heads, F, values.shape[-1], dtype=torch.promote_types(values.dtype, torch.float32),
            device=keys.device)
        read_z = state.z.clone() if state is not None else read_S.new_zeros(B, attn.num_heads, F)
    tail = None
    if isinstance(attn, MacchiatoAttention) and attn.conv is not None:
        tail = entry.conv_tail.clone() if entry.conv_tail is not None else keys.new_zeros(
            B, attn.conv.kernel_size - 1, attn.hidden_size)
    return _LayerBuffers(slot_k, slot_v, sink_k.clone(), sink_idx.clone(), sink_ok.clone(), m, z, memory, read_S,
                         read_z, tail)


def _attention_step(attn: WindowAttention, buf: _LayerBuffers, h: torch.Tensor, cos_sin, t: torch.Tensor):
    """One token through one Macchiato (delta, hedgehog) layer over its fixed buffers: ``(B, 1, hidden)``."""
    B = h.shape[0]
    q, k, v = attn.patch.project_qkv(attn, h, cos_sin)  # (B, Hq|Hkv, 1, d)
    n, w = buf.sink_k.shape[2], attn.window
    slot = (n + t % w).view(1)
    buf.slot_k.index_copy_(2, slot, k)
    buf.slot_v.index_copy_(2, slot, v)
    allowed_ring = (torch.arange(w, device=h.device) <= t).expand(B, w)
    if n:
        sinks_seen = buf.sink_ok & (buf.sink_idx <= t - w)  # a sink inside the window is its ring slot
        if attn.sink_inv_freq is not None:
            capped = capped_sink_keys(buf.sink_k, buf.sink_idx, t, attn.sink_distance, attn.sink_inv_freq.to(h.device))
            buf.slot_k[:, :, :n] = capped.to(buf.slot_k.dtype)
        allowed = torch.cat([sinks_seen, allowed_ring], dim=1)
    else:
        allowed = allowed_ring
    if buf.read_S is not None:
        return attn.patch.project_out(attn, _hedgehog_step(attn, buf, q, allowed, cos_sin, t))
    mix, lat, tail = attn.mixing_logits(h, None, buf.conv_tail)
    state = None if buf.m is None else LatteState(buf.m, buf.z)
    out, state = macchiato_slot_step(q, buf.slot_k, buf.slot_v, allowed, v, mix, lat, state,
                                     scaling=attn.scaling, softcap=attn.softcap)
    if state is not None:
        buf.m.copy_(state.m)
        buf.z.copy_(state.z)
    if buf.memory is not None and not attn.latent_path_closed:  # the eager DeltaAttention.attend's step
        read, memory = delta_rule_step(*attn.memory_inputs(q, k, v, h), DeltaState(buf.memory))
        buf.memory.copy_(memory.memory)
        out = out + (attn.memory_share(mix) * read).to(out.dtype)
    if tail is not None:
        buf.conv_tail.copy_(tail)
    return attn.patch.project_out(attn, out)


def _hedgehog_step(attn: HedgehogAttention, buf: _LayerBuffers, q: torch.Tensor, allowed: torch.Tensor, cos_sin,
                   t: torch.Tensor) -> torch.Tensor:
    """The eager hedgehog slot step's arithmetic over the fixed buffers: ``(B, Hq, 1, D)``."""
    out, lse = slot_attention_step(q, buf.slot_k, buf.slot_v, allowed, scaling=attn.scaling, with_lse=True)
    if attn.latent_path_closed:
        return out
    n, w = buf.sink_k.shape[2], attn.window
    leaving = t - w + 1  # the oldest token of this query's window: no later window holds it
    slot = (n + (t + 1) % w).view(1)
    write = (leaving >= 0).view(1, 1).expand(q.shape[0], 1)
    if n:
        write = write & ~((buf.sink_idx == leaving) & buf.sink_ok).any(-1, keepdim=True)
    out, state = attn.memory_step(q, buf.slot_k.index_select(2, slot), buf.slot_v.index_select(2, slot), write,
                                  HedgehogState(buf.read_S, buf.read_z), cos_sin, out, lse)
    buf.read_S.copy_(state.S)
    buf.read_z.copy_(state.z)
    return out
