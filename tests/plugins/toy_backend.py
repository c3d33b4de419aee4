"""A toy kernel backend: the torch kernel of one op under another name, registered at import."""
from retrofit.ops import causal_latte
from retrofit.ops.backends import Backend, register_backend

NAME = "toyplugin"

BACKEND = register_backend(Backend(name=NAME, priority=-1, kernels={"causal_latte": causal_latte.torch_kernel}))
