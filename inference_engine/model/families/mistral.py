"""Mistral: a llama block (mlx-lm runs it with its llama module)."""

from inference_engine.model.families.base import Family

FAMILY = Family(model_type="mistral", gguf_arch="llama", gguf_permutes_qk=True)
