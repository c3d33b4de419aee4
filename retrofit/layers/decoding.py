"""What a layer implements to be decoded by :class:`retrofit.decoding.CompiledDecoder`: its own
one-token step over fixed-shape buffers, which ``torch.compile`` traces into one graph.

The decoder is generic: it runs the pretrained parts (norms, the family patch's q/k/v and output
projections, the MLP, the rotary embedding) and hands each attention layer its projected ``q``,
``k``, ``v`` and its own buffers. A layer opts in by implementing :class:`CompiledDecodingLayer`:

* ``compiled_decoding_support()``: None where its step applies to the layer as configured, else
  the reason it does not (the model is then decoded eagerly);
* ``init_decoding_buffers(entry)``: after an eager prefill, its decoding-cache entry (the one
  ``new_cache_layer()`` returned) copied into a :class:`DecodingBuffers` of fixed shapes (ring
  slots, states; nothing that grows with the context);
* ``decoding_step(buffers, q, k, v, *, hidden_states, position_embeddings, position)``: one token's
  attention output before the output projection, updating ``buffers`` in place
  (``index_copy_`` / ``copy_``: the compiled graph never changes from token to token).

A layer without these methods is refused with the reason (decode it eagerly). Each method keeps
its buffers as a dataclass next to its layer; the window methods share the window's
(:class:`retrofit.layers.window.WindowDecodingBuffers`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CompiledDecodingLayer", "DecodingBuffers", "supports_compiled_decoding"]


@dataclass
class DecodingBuffers:
    """Base of one layer's compiled-decoding state: a dataclass whose fields are fixed-shape tensors
    (or None for a part the layer does not have), updated in place by the layer's step."""

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held, in field order."""
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]

    def nbytes(self) -> int:
        """Bytes held by :meth:`tensors`."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


@runtime_checkable
class CompiledDecodingLayer(Protocol):
    """The interface an attention layer implements for compiled decoding (see the module docstring)."""

    def compiled_decoding_support(self) -> str | None:
        """None where the layer's compiled step applies to it as configured, else the reason it does not."""
        ...

    def init_decoding_buffers(self, entry: Any) -> DecodingBuffers:
        """The layer's decoding state after a prefill, taken from its cache ``entry``, in fixed shapes."""
        ...

    def decoding_step(self, buffers: DecodingBuffers, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      hidden_states: torch.Tensor, position_embeddings: Any, position: torch.Tensor) -> torch.Tensor:
        """One token: ``q (B, Hq, 1, d)``, ``k (B, Hkv, 1, d)``, ``v (B, Hkv, 1, D)`` (post-RoPE),
        ``hidden_states (B, 1, hidden)`` the layer's input, ``position_embeddings`` its ``(cos, sin)``,
        ``position`` the token's stream index (0-dim long tensor). Returns ``(B, Hq, 1, D)`` before the
        output projection, with ``buffers`` moved one token on in place."""
        ...


def supports_compiled_decoding(module: Any) -> bool:
    """Whether ``module`` implements :class:`CompiledDecodingLayer`."""
    return isinstance(module, CompiledDecodingLayer)
