"""Short causal depthwise convolution on the latent-branch input (Latte paper, Section 2.4).

``y_t = sum_{i<K} w_i * x_{t-i}`` per channel. Initialised to the identity (``w_0 = 1``), so
adding it does not change a freshly converted model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalDepthwiseConv"]


class CausalDepthwiseConv(nn.Module):
    """``(B, T, C) -> (B, T, C)``; carries the last ``K - 1`` inputs between calls for decoding.

    Args:
        channels: ``C``, the input's last dimension.
        kernel_size: ``K`` taps (the last one multiplies ``x_t``; identity at initialisation).

    Returns:
        Called as ``conv(x (B, T, C), tail (B, K - 1, C) | None)``: ``(y (B, T, C), new tail (B, K - 1, C))``.

    Example::

        >>> import torch
        >>> from retrofit.layers import CausalDepthwiseConv
        >>> conv = CausalDepthwiseConv(channels=6, kernel_size=3)
        >>> x = torch.randn(2, 5, 6)
        >>> y, tail = conv(x)
        >>> torch.equal(y, x), tail.shape  # the identity at initialisation
        (True, torch.Size([2, 2, 6]))
    """

    def __init__(self, channels: int, kernel_size: int, *, device=None, dtype=None):
        super().__init__()
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:, 0, -1] = 1.0  # the last tap multiplies x_t

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``(B, T, C)``, tail ``(B, K-1, C)`` (previous inputs, zeros if None). Returns ``(y, new tail)``."""
        B, T, C = x.shape
        K = self.kernel_size
        if tail is None:
            tail = x.new_zeros(B, K - 1, C)
        xt = torch.cat([tail.to(x.dtype), x], dim=1)  # (B, K-1+T, C)
        y = F.conv1d(xt.transpose(1, 2), self.weight.to(x.dtype), groups=C).transpose(1, 2)
        return y, xt[:, xt.shape[1] - (K - 1) :]

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}"
