"""Tiny GGUF files of every family, written by gguf-py from the family's tiny random model (tests/family_models.py).

Names, Q/K row permutation (llama) and `1 + w` norms (Gemma) are written as llama.cpp's
converter writes them. Linears take the ggml type the caller assigns: the float and legacy
quant types through gguf-py's own quantizers; K-quants (gguf-py has no quantizer for them)
as random blocks with sane fp16 scales, whose gguf-py dequantization is the expected weight.
"""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
import numpy as np

from inference_engine.model.families import family_of
from inference_engine.model.gguf_convert import _BLOCK_NAMES
from tests.family_models import FAMILY_CONFIGS
from tests.tiny_gguf import _permute
from tests.tiny_models import TINY_ARGS, random_model

K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of fp16 scales in a block


def gguf_name(family, mlx_name: str) -> str:
    """mlx-lm parameter name -> GGUF tensor name (the inverse of gguf_model._mlx_name)."""
    if mlx_name.startswith("model.embed_tokens."):
        return "token_embd." + mlx_name.rsplit(".", 1)[1]
    if mlx_name.startswith("model.norm."):
        return "output_norm." + mlx_name.rsplit(".", 1)[1]
    if mlx_name.startswith("lm_head."):
        return "output." + mlx_name.rsplit(".", 1)[1]
    _, _, block, rest = mlx_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    pairs = [*family.gguf_names, *((k.split(".")[0], v.removesuffix(".weight")) for k, v in _BLOCK_NAMES.items())]
    return f"blk.{block}.{next(src for src, dst in pairs if dst == module)}.{suffix}"


def random_k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random, finite blocks of a K-quant type: (rows, cols / 256 * block bytes) uint8."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at in K_QUANT_SCALES[kind]:
        blocks[..., at : at + 2] = np.frombuffer(np.float16(rng.uniform(0.001, 0.02)).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_family_gguf(name: str, path: Path, types: dict[str, str] | None = None, seed: int = 0,
                      layers: int = 2) -> dict[str, np.ndarray]:
    """Write family `name`'s tiny model (intermediate 256, so down projections can be K-quants) to `path`.

    Args:
        types: mlx-lm linear weight name -> ggml type name (others: F32).
        layers: its number of blocks.
    Returns:
        mlx-lm parameter name -> the fp32 weight a loader must produce (gguf-py's dequantization).
    """
    import gguf

    types = types or {}
    cfg = {**TINY_ARGS, **FAMILY_CONFIGS[name], "intermediate_size": 256, "num_hidden_layers": layers}
    overrides = {k: v for k, v in cfg.items() if k not in TINY_ARGS or TINY_ARGS[k] != v}
    model = random_model(seed, random_norms=True, **overrides).model
    family = family_of(cfg["model_type"])
    arch, rng = family.gguf_arch, np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = family.head_dim(model.args)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    if "sliding_window" in cfg:
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([(i + 1) % cfg["sliding_window_pattern"] != 0 for i in range(layers)])
    vocab = cfg["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, vocab)])
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    expected = {}
    heads = {"q_proj": model.args.num_attention_heads, "k_proj": model.args.num_key_value_heads}
    for key, value in nn.utils.tree_flatten(model.parameters()):
        a = np.array(value, dtype=np.float32)
        gname = gguf_name(family, key)
        if "norm" in key and family.gguf_norms_plus_one:
            a = np.float32(1.0) + a  # llama.cpp stores Gemma's norms as 1 + w (fp32, one rounding)
        n = next((h for m, h in heads.items() if f".{m}." in key), None)
        stored = _permute(a, n) if family.gguf_permutes_qk and n is not None else a
        kind = types.get(key, "F32")
        if kind == "F32":
            w.add_tensor(gname, stored)
            expected[key] = a
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        blocks = (random_k_blocks(kind, *stored.shape, rng) if kind in K_QUANT_SCALES
                  else gguf.quantize(stored, qtype))
        w.add_tensor(gname, blocks, raw_dtype=qtype)
        deq = np.asarray(gguf.dequantize(blocks, qtype), dtype=np.float32).reshape(stored.shape)
        expected[key] = np.asarray(_unpermute(deq, n) if family.gguf_permutes_qk and n is not None else deq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _unpermute(w: np.ndarray, n: int) -> np.ndarray:
    from inference_engine.model.gguf_convert import _unpermute_rows

    return _unpermute_rows(w, n)
