"""A toy conversion method: its module registers it at import (never converts anything)."""
from retrofit.layers.method import register_method

NAME = "toy-plugin-method"


def build(original, patch, spec, layer_idx, generator):
    raise NotImplementedError("a registry test entry")


register_method(NAME, build, options={"gain": 1.0}, description="registry test entry")
