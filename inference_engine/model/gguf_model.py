"""`serve --model FILE.gguf`: a model of a supported family straight from a GGUF file.

Config, tokenizer and chat template come from the file's metadata (no hub, no folder). With
`--weights q4_1` (the default) the blocks are served as stored (gguf_file_blocks.py); with
`--weights fp32`, or where the exact block kernel is unavailable, every tensor is dequantized
by gguf-py in fp32 here. Both compute bitwise the fp32 product of gguf-py's dequantization of
its blocks; llama.cpp's Q/K row permutation is undone for the families
whose converter made it, and norms stored as `1 + w` are marked as effective weights
(families/base.py). A tensor of a type not in `SUPPORTED_TYPES` stops the start-up with its
name and type.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.model.families import Family, family_of_gguf
from inference_engine.model.gguf_convert import _BLOCK_NAMES, _unpermute_rows
from inference_engine.model.gguf_reader import GgufFile, TensorInfo, read_gguf

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
log = logging.getLogger(__name__)


def check_tensor_types(g: GgufFile) -> None:
    """Raises ValueError naming the first tensor whose type we do not serve."""
    for t in g.tensors:
        if t.type_name not in SUPPORTED_TYPES:
            raise ValueError(f"{g.path.name}: tensor {t.name} has ggml type {t.type_name}, which is not served; "
                             f"supported types: {', '.join(SUPPORTED_TYPES)}")


def gguf_config(g: GgufFile, family: Family) -> dict[str, Any]:
    """The mlx-lm config of the file's model (common fields, then the family's own)."""
    arch = family.gguf_arch

    def get(key: str, default: Any = None) -> Any:
        v = g.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"{g.path.name}: the GGUF metadata has no {arch}.{key}")
        return v

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    names = {t.name for t in g.tensors}
    cfg: dict[str, Any] = {
        "model_type": family.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": len(g.metadata["tokenizer.ggml.tokens"]),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_traditional": False,
    }
    if "rope_freqs.weight" in names:  # llama.cpp's form of Llama 3 rope_scaling
        raise ValueError(f"{g.path.name}: a rope_freqs tensor (Llama 3 RoPE scaling as llama.cpp stores it) is not "
                         "served yet; serve the model's mlx-lm folder instead")
    if family.gguf_config is not None:
        cfg.update(family.gguf_config(get))
    return cfg


def _mlx_name(family: Family, gguf_name: str) -> str:
    """A GGUF tensor name -> the mlx-lm parameter name, the family's names first."""
    if gguf_name.startswith("token_embd."):
        return "model.embed_tokens." + gguf_name.split(".", 1)[1]
    if gguf_name.startswith("output_norm."):
        return "model.norm." + gguf_name.split(".", 1)[1]
    if gguf_name.startswith("output."):
        return "lm_head." + gguf_name.split(".", 1)[1]
    if gguf_name.startswith("blk."):
        _, block, rest = gguf_name.split(".", 2)
        for src, dst in (*family.gguf_names, *((k.split(".")[0], v.removesuffix(".weight"))
                                                for k, v in _BLOCK_NAMES.items())):
            stem, _, suffix = rest.rpartition(".")
            if stem == src:
                return f"model.layers.{block}.{dst}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {family.model_type} model")


def dequantize(g: GgufFile, t: TensorInfo) -> np.ndarray:
    """Tensor `t` in fp32 as gguf-py dequantizes it (numpy order)."""
    import gguf

    raw = g.tensor_bytes(t)
    kind = gguf.GGMLQuantizationType(t.kind)
    if kind == gguf.GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(t.shape)
    rows = int(np.prod(t.shape[:-1]))
    w = gguf.quants.dequantize(raw.reshape(rows, -1), kind)
    return np.asarray(w, dtype=np.float32).reshape(t.shape)


def gguf_weights(g: GgufFile, family: Family, cfg: dict[str, Any]) -> dict[str, mx.array]:
    """Every tensor of the file as an fp32 mlx-lm parameter (Q/K rows un-permuted where the family's were)."""
    heads = {"attn_q.": cfg["num_attention_heads"], "attn_k.": cfg["num_key_value_heads"]}
    out, start = {}, time.monotonic()
    for i, t in enumerate(g.tensors, 1):
        w = dequantize(g, t)
        n = next((h for key, h in heads.items() if f".{key}" in t.name), None)
        if family.gguf_permutes_qk and n is not None:
            w = _unpermute_rows(w, n)
        out[_mlx_name(family, t.name)] = mx.array(w)
        if i % 64 == 0:
            mx.eval(list(out.values()))
            log.info("GGUF: dequantized %d/%d tensors (%.0f s)", i, len(g.tensors), time.monotonic() - start)
    return out


def _tokenizer_dict(g: GgufFile) -> dict[str, Any]:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    meta = g.metadata
    tok = {name: meta[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
           if f"tokenizer.{key}" in meta}
    for k, v in list(tok.items()):
        tok[k] = v.tolist() if isinstance(v, np.ndarray) else v.item() if isinstance(v, np.generic) else v
    return tok


def gguf_tokenizer(g: GgufFile, cache_dir: Path | None = None) -> Any:
    """A transformers fast tokenizer built from the file's metadata (transformers' GGUF mapping; no torch).

    Building Gemma's (merges recovered from a 262k vocabulary) takes ~20 s; with `cache_dir` the
    result is kept as `<cache>/gguf-tokenizers/<sha256 of the tokenizer metadata>.json`.
    """
    import hashlib
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tok = _tokenizer_dict(g)
    arch = str(g.get("general.architecture"))
    key = hashlib.sha256(json.dumps([arch, tok], sort_keys=True, default=str).encode()).hexdigest()
    cached = cache_dir / "gguf-tokenizers" / f"{key}.json" if cache_dir is not None else None
    if cached is not None and cached.is_file():
        backend = Tokenizer.from_file(str(cached))
    else:
        backend, _ = convert_gguf_tokenizer(arch, tok)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(".partial")
            backend.save(str(partial))
            partial.replace(cached)
    tokens = tok["tokens"]

    def special(key: str) -> str | None:
        i = g.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None else None

    add_bos, bos = bool(g.get("tokenizer.ggml.add_bos_token", False)), g.get("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None:  # a sequence starts as the file says (Gemma's <bos>), as llama.cpp starts it
        _start_with(backend, tokens[int(bos)], int(bos))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        chat_template=g.get("tokenizer.chat_template"), add_bos_token=add_bos,
    )


def _start_with(backend: Any, token: str, token_id: int) -> None:
    """Make `backend` put `token` first in every sequence it encodes with add_special_tokens (none without)."""
    from tokenizers import processors

    if backend.encode("a", add_special_tokens=True).ids[:1] == [token_id]:
        return  # its own post-processor does already
    template = processors.TemplateProcessing(single=f"{token} $A", pair=f"{token} $A {token} $B:1",
                                             special_tokens=[(token, token_id)])
    current = backend.post_processor
    backend.post_processor = template if current is None else processors.Sequence([current, template])


def build_gguf_model(g: GgufFile) -> tuple[nn.Module, dict[str, Any]]:
    """The file's model (fp32, gguf-py's dequantization) as an mlx-lm model object, and its config.

    Raises:
        ValueError: an unsupported architecture or tensor type, or tensors that do not fit the config.
    """
    from mlx_lm.utils import _get_classes

    family = family_of_gguf(str(g.get("general.architecture")))
    check_tensor_types(g)
    cfg = gguf_config(g, family)
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    weights = gguf_weights(g, family, cfg)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)  # drops a tied head, as mlx-lm's loader does
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    mark_norms_stored(model, family)
    return model, cfg


def load_gguf(path: Path, cache_dir: Path | None = None, build: Any = None) -> tuple[nn.Module, dict[str, Any], Any]:
    """(model, config, tokenizer) of a GGUF file (see `build_gguf_model`, `gguf_tokenizer`).

    Args:
        build: (GgufFile) -> (model, config) building the model another way (gguf_file_blocks: the
            file's blocks as stored); None: `build_gguf_model`, fp32 dequantization.
    """
    g = read_gguf(path)
    model, cfg = (build or build_gguf_model)(g)
    eos = g.get("tokenizer.ggml.eos_token_id")
    cfg["eos_token_id"] = [] if eos is None else [int(eos)]
    cfg["gguf_types"] = sorted({t.type_name for t in g.tensors})
    return model, cfg, gguf_tokenizer(g, cache_dir)


def mark_norms_stored(model: nn.Module, family: Family) -> None:
    """A family whose GGUF stores its norms as `1 + w` (Gemma) reads them as they are, not adding 1 again."""
    if family.gguf_norms_plus_one:
        model.__dict__["_norms_effective"] = True
        for layer in model.model.layers:
            layer.__dict__["_norms_effective"] = True
