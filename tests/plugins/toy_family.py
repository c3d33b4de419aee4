"""A toy model family (a LLaMA-shaped row under a made-up model_type), registered at import."""
from retrofit.patches import Family, register_family

NAME, MODEL_TYPE = "toy-plugin-family", "toy_plugin_llama"

register_family(Family(NAME, (MODEL_TYPE,), "transformers.models.llama.modeling_llama", "LlamaAttention"))
