"""Kernel backends for the ops in :mod:`retrofit.ops`, through one registry.

Each backend is one module of this package that declares what it runs and registers itself
(:func:`~retrofit.ops.backends.registry.register_backend`); the registry imports every module
here on first use, so adding a backend is adding its module (a backend outside this package:
:mod:`retrofit.plugins`). Today:

* ``torch`` (:mod:`.pytorch`) - the pure-PyTorch kernels; every op, any device and dtype.
* ``fla``   (:mod:`.fla`)     - causal Latte / exp-linear on flash-linear-attention's GLA
  Triton kernels; CUDA, fp16/bf16 (fp32 on request: TF32 dots); decoding steps on request; the
  gated delta rule on its chunk kernel, on request.
* ``flash`` (:mod:`.flash`)   - the sliding window on flash-attn 2; CUDA, fp16/bf16, no padding.
* ``flex``  (:mod:`.flex`)    - the sliding window on PyTorch flex attention; only on request.

How a backend is chosen (``backend=``, :func:`set_default_backend` / :func:`use_backend`,
``RETROFIT_BACKEND``, ``auto``) is described in :mod:`.registry`. The ops themselves are
``retrofit.ops.<op>`` (one public name each).
"""
from __future__ import annotations

from retrofit.ops.backends import registry as _registry
from retrofit.ops.backends.registry import *  # noqa: F401,F403 - the registry's public names
from retrofit.ops.backends.registry import _reset_log_memory  # noqa: F401 - tests

__all__ = list(_registry.__all__)
