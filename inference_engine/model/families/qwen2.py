"""Qwen2 / Qwen2.5: a llama block with a bias on Q, K and V (the bias arrays ride with the fused q/k/v)."""

from inference_engine.model.families.base import Family

FAMILY = Family(model_type="qwen2", gguf_arch="qwen2")
