"""Gemma 3 (text): GeGLU (gelu tanh), `1 + w` norms, q/k norms, sandwich norms, embedding x bf16(sqrt(hidden)).

Every `sliding_window_pattern`-th layer is global (RoPE base `rope_theta`, scaling allowed); the
others attend to the model's last `sliding_window` positions (RoPE base `rope_local_base_freq`);
each layer's RoPE is read from its own module, so the local/global bases need nothing here.
"""

from typing import Any, Callable

from inference_engine.model.families.base import Family, bf16_sqrt_hidden


def layer_window(args: Any, i: int) -> int | None:
    """The model's window for its local layers, None for the global ones (mlx-lm's rule)."""
    pattern = int(args.sliding_window_pattern)
    return None if i % pattern == pattern - 1 else int(args.sliding_window)


def gguf_config(get: Callable[[str, Any], Any]) -> dict:
    """Gemma 3's fields from a GGUF (llama.cpp: local RoPE base 10000, every 6th layer global)."""
    head_dim = int(get("attention.key_length", 256))
    pattern = get("attention.sliding_window_pattern", 6)
    if not isinstance(pattern, int):  # newer files: one flag per layer (True: sliding); the first global ends a period
        pattern = [bool(f) for f in pattern].index(False) + 1
    return {"sliding_window": int(get("attention.sliding_window", 512)), "sliding_window_pattern": int(pattern),
            "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": head_dim}


FAMILY = Family(
    model_type="gemma3_text", activation="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norms=True,
    embed_scale=bf16_sqrt_hidden, logit_softcap_arg="final_logit_softcapping", layer_window=layer_window,
    gguf_arch="gemma3", gguf_norms_plus_one=True, gguf_config=gguf_config,
    gguf_names=(("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                ("post_attention_norm", "post_attention_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
                ("ffn_norm", "pre_feedforward_layernorm")),
)
