"""Loading a causal LM (mlx-lm architecture code) plus its tokenizer metadata."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.model.gguf_blocks import QMatmul, load_gguf_blocks

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")  # llama-family mlx-lm architectures we run


@dataclass(frozen=True)
class ModelSpec:
    """Shape facts the runtime needs about a loaded model."""

    name: str  # folder name or a test label
    vocab_size: int  # logits width; token ids must be below it
    num_layers: int  # transformer blocks
    num_kv_heads: int  # K/V heads per layer
    head_dim: int  # per-head width
    eos_token_ids: tuple[int, ...]  # the tokenizer's end-of-sequence ids
    is_quantized: bool  # linears are MLX quantized layers


@dataclass(frozen=True)
class LoadedModel:
    """An mlx-lm model object, its spec and (optionally) its tokenizer."""

    model: nn.Module  # mlx-lm `Model`; we call its submodules, never its cache
    spec: ModelSpec  # shape facts
    tokenizer: Any | None  # a transformers tokenizer, None for random test models


def spec_of(model: nn.Module, name: str, eos: tuple[int, ...] = (), quantized: bool = False) -> ModelSpec:
    """The shape facts of an mlx-lm model object."""
    args = model.args
    return ModelSpec(
        name=name,
        vocab_size=int(args.vocab_size),
        num_layers=int(args.num_hidden_layers),
        num_kv_heads=int(args.num_key_value_heads),
        head_dim=int(args.head_dim or args.hidden_size // args.num_attention_heads),
        eos_token_ids=eos,
        is_quantized=quantized,
    )


def load_model(path: Path) -> LoadedModel:
    """Load an mlx-lm style folder (config.json, *.safetensors, tokenizer files) offline.

    Raises:
        FileNotFoundError: the folder or its config is missing.
        ValueError: the architecture is not a llama-family model we can run.
    """
    from mlx_lm.utils import load_tokenizer

    model, config = load_weights(path, lazy=False)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    eos = tuple(sorted(int(t) for t in tokenizer.eos_token_ids))
    return LoadedModel(model, spec_of(model, path.name, eos, "quantization" in config), tokenizer._tokenizer)


def load_block_model(path: Path, gguf_path: Path, qmatmul: QMatmul) -> LoadedModel:
    """The model of folder `path` with the GGUF's own blocks for weights (see gguf_blocks.py).

    `path` is the folder converted from `gguf_path` (architecture, config, tokenizer); its fp32
    weights are never read.

    Raises:
        FileNotFoundError / ValueError: as `load_model`, or the GGUF does not fit the folder.
    """
    from mlx_lm.utils import load_tokenizer

    model, config = load_weights(path, lazy=True)  # the fp32 arrays stay unread: all are replaced
    load_gguf_blocks(model, gguf_path, qmatmul)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    eos = tuple(sorted(int(t) for t in tokenizer.eos_token_ids))
    return LoadedModel(model, spec_of(model, path.name, eos), tokenizer._tokenizer)


def load_weights(path: Path, lazy: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    """An mlx-lm folder's model object and config, without its tokenizer.

    Lazy weights are read when first evaluated (a shard worker materializes only its layers).

    Raises:
        FileNotFoundError: no config.json in `path`.
        ValueError: not a llama-family model.
    """
    from mlx_lm.utils import load_model as mlx_lm_load_model

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an mlx-lm model folder (no config.json)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (llama family only)")
    return mlx_lm_load_model(path, lazy=lazy)


def model_fingerprint(model: nn.Module) -> str:
    """Hex SHA-256 over the model's shape arguments and its first embedding rows (as the model embeds them).

    A model served from GGUF blocks embeds bitwise the rows of its fp32 conversion: the same
    fingerprint, and a route may mix the two (their logits are bitwise equal).
    """
    a = model.args
    h = hashlib.sha256()
    for name in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "intermediate_size"):
        h.update(f"{name}={getattr(a, name, None)};".encode())
    h.update(np.array(model.model.embed_tokens(mx.arange(8))).tobytes())  # rows 0..7, however they are stored
    return h.hexdigest()


def random_model(seed: int = 0, **overrides: Any) -> LoadedModel:
    """A tiny random-weight llama for fast unit tests (no tokenizer).

    Args:
        seed: MLX random seed for the weights.
        overrides: ModelArgs fields to change from the tiny defaults.
    """
    from mlx_lm.models.llama import Model, ModelArgs

    fields = dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        rope_theta=10000.0, tie_word_embeddings=True,
    )
    fields.update(overrides)
    mx.random.seed(seed)
    model = Model(ModelArgs(**fields))
    # Default init leaves norms at 1 and is too tame; scale weights so logits spread.
    model.update(nn.utils.tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return LoadedModel(model, spec_of(model, f"random-{seed}", (1,), False), None)
