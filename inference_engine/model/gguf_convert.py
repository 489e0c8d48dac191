"""One-time conversion of a llama-architecture GGUF into mlx-lm model folders.

Produces an fp32 folder (weights dequantized exactly, in fp32) and a quantized folder
(the GGUF's own 4-bit groups kept as MLX quantized tensors) that share one tokenizer.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
PROGRESS_EVERY = 50  # tensors between progress lines (a 135M model has ~270)

# GGUF tensor names (per block) -> mlx-lm / HF llama names.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_CONTROL_TOKEN_TYPE = 3
MARKER = "conversion.json"


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of Q/K (rows = output dims)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor base name (no .weight suffix for linears) to the mlx-lm name."""
    if gguf_name.startswith("token_embd"):
        return "model.embed_tokens" + gguf_name[len("token_embd"):]
    if gguf_name.startswith("output_norm"):
        return "model.norm" + gguf_name[len("output_norm"):]
    _, block, rest = gguf_name.split(".", 2)
    for src, dst in _BLOCK_NAMES.items():
        if rest.startswith(src):
            return f"model.layers.{block}.{dst}{rest[len(src):]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def _model_config(meta: dict) -> dict:
    arch = str(meta["general.architecture"])
    if arch != "llama":
        raise ValueError(f"only GGUF arch 'llama' is supported, got {arch!r}")
    g = lambda key: meta[f"llama.{key}"].item()  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(g("vocab_size")),
        "rope_theta": float(g("rope.freq_base")),
        "max_position_embeddings": int(g("context_length")),
        "tie_word_embeddings": True,
        "rope_traditional": False,
    }


def _write_tokenizer(meta: dict, out: Path) -> None:
    """Build a byte-level BPE tokenizer.json (SmolLM pre-tokenizer) from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = np.asarray(meta["tokenizer.ggml.token_type"]).tolist()
    merges = [tuple(str(m).split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL_TOKEN_TYPE]
    )
    tok.save(str(out / "tokenizer.json"))
    ids = {k: int(meta[f"tokenizer.ggml.{k}_token_id"].item()) for k in ("bos", "eos", "unknown")}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[ids["bos"]],
        "eos_token": tokens[ids["eos"]],
        "unk_token": tokens[ids["unknown"]],
        "pad_token": tokens[ids["eos"]],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(meta["llama.context_length"].item()),
        "chat_template": str(meta.get("tokenizer.chat_template", "")) or None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def convert_gguf(gguf_path: Path, fp32_dir: Path, quant_dir: Path | None = None) -> None:
    """Convert `gguf_path` into an fp32 mlx-lm folder and optionally a quantized one.

    Args:
        gguf_path: a llama-architecture GGUF whose linears are Q4_1/Q8_0 (or float).
        fp32_dir: output folder for the exactly dequantized fp32 model.
        quant_dir: output folder for the model kept in MLX quantized form (group 32).
    Raises:
        ValueError: the GGUF is not a supported llama model.
    """
    import gguf
    import mlx.core as mx

    start = time.monotonic()
    log.info("converting %s (first use; this takes a minute): reading the GGUF", gguf_path.name)
    raw, meta = mx.load(str(gguf_path), return_metadata=True)
    config = _model_config(meta)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def permute_for(name: str) -> int | None:
        return next((n for key, n in heads.items() if f".{key}." in name), None)

    # fp32: dequantize every tensor in fp32 with gguf-py (mlx's dequantize rounds via fp16).
    fp32: dict[str, mx.array] = {}
    tensors = gguf.GGUFReader(str(gguf_path)).tensors
    for i, t in enumerate(tensors, 1):
        w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        n = permute_for(t.name)
        if n is not None:
            w = _unpermute_rows(w, n)
        fp32[_hf_name(t.name)] = mx.array(w)
        if i % PROGRESS_EVERY == 0 or i == len(tensors):
            log.info("fp32: dequantized %d/%d tensors (%.0f s)", i, len(tensors), time.monotonic() - start)
    log.info("fp32: writing %s", fp32_dir)
    _write_folder(fp32_dir, fp32, config, meta)

    if quant_dir is not None:
        quant: dict[str, mx.array] = {}
        qconfig: dict = {"group_size": 32, "bits": 4}
        for name, arr in raw.items():
            base = name.rsplit(".", 1)[0]
            n = permute_for(name)
            if n is not None:
                arr = mx.array(_unpermute_rows(np.asarray(arr), n))
            quant[_hf_name(name)] = arr
            if name.endswith(".scales"):
                bits = 32 * raw[base + ".weight"].shape[1] // (arr.shape[1] * 32)
                if bits != 4:
                    qconfig[_hf_name(base)] = {"group_size": 32, "bits": bits}
        log.info("q4: writing %s (%d tensors kept in 4-bit groups)", quant_dir, len(quant))
        _write_folder(quant_dir, quant, {**config, "quantization": qconfig}, meta)
    log.info("conversion done in %.0f s", time.monotonic() - start)


def _write_folder(out: Path, weights: dict, config: dict, meta: dict) -> None:
    import mlx.core as mx

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(meta, tmp)
    (tmp / MARKER).write_text(json.dumps({"complete": True}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
