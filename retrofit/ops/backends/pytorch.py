"""The ``torch`` backend: the pure-PyTorch kernels of :mod:`retrofit.ops` (any device, any dtype,
differentiable). It runs every op, so it is what ``auto`` falls back to (lowest priority). Its
kernels are the ones the ops are declared with (:data:`retrofit.ops.dispatched.OPS`)."""
from __future__ import annotations

from retrofit.ops.backends.registry import Backend, register_backend
from retrofit.ops.dispatched import OPS

BACKEND = register_backend(Backend(name="torch", priority=0, kernels={op.name: op.torch_kernel for op in OPS}))
