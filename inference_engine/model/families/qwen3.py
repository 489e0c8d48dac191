"""Qwen3: a llama block whose q and k heads are RMS-normed before RoPE; `head_dim` from the config."""

from inference_engine.model.families.base import Family

FAMILY = Family(
    model_type="qwen3", qk_norm=True, gguf_arch="qwen3",
    gguf_names=(("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")),
)
