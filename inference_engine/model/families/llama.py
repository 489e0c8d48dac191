"""Llama 2/3.x, SmolLM: the plain block (SiLU MLP, `w` norms, RoPE incl. Llama 3 `rope_scaling`)."""

from inference_engine.model.families.base import Family

FAMILY = Family(model_type="llama", gguf_arch="llama", gguf_permutes_qk=True)
