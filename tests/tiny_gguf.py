"""A tiny llama GGUF laid out like the packaged one: Q4_1 linears, a Q8_0 tied embedding, F32 norms.

Written with gguf-py's writer from random weights (Q/K rows in llama.cpp's permuted order),
with just enough tokenizer metadata for the converter; a test converts it with the real
converter and serves it from its blocks, which must give the fp32 folder's bits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 128, 256


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: HF rows -> interleaved-RoPE rows (the inverse of _unpermute_rows)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write the tiny model to `path` and return it."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, VOCAB)])
    writer.add_token_types([1] * (VOCAB - 2) + [3, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_unk_token_id(0)

    def quantized(name: str, w: np.ndarray, qtype) -> None:
        writer.add_tensor(name, gguf.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)  # (rows, bytes)

    q4, q8 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    quantized("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)), q8)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
                  "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        for name, shape in shapes.items():
            w = rng.standard_normal(shape) * 0.3
            if name in ("attn_q", "attn_k"):
                w = _permute(w, HEADS if name == "attn_q" else KV_HEADS)
            quantized(f"blk.{i}.{name}.weight", w, q4)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
