"""Loading a causal LM (mlx-lm architecture code) plus its tokenizer metadata."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.model.families import family_of, family_of_model, supported_types
from inference_engine.model.gguf_blocks import QMatmul, load_gguf_blocks

log = logging.getLogger(__name__)

SUPPORTED_TYPES = supported_types()  # the mlx-lm architectures we run (model/families/)


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
    family: str = "llama"  # the model family's `model_type` (model/families/)
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window (keys incl. itself), None: global
    weight_formats: tuple[str, ...] = field(default=("fp32",), compare=False)
    # "fp32", "mlx-quantized", or the source GGUF's ggml types (not a shape fact: equal specs may differ here)

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for a global layer."""
        return self.layer_windows[layer] if self.layer_windows else None


@dataclass(frozen=True)
class LoadedModel:
    """An mlx-lm model object, its spec and (optionally) its tokenizer."""

    model: nn.Module  # mlx-lm `Model`; we call its submodules, never its cache
    spec: ModelSpec  # shape facts
    tokenizer: Any | None  # a transformers tokenizer, None for random test models


def spec_of(model: nn.Module, name: str, eos: tuple[int, ...] = (), quantized: bool = False,
            formats: tuple[str, ...] | None = None) -> ModelSpec:
    """The shape facts of an mlx-lm model object (its family's adapter says what differs)."""
    args = model.args
    family = family_of_model(model)
    windows = family.windows(args)
    return ModelSpec(
        name=name,
        vocab_size=int(args.vocab_size),
        num_layers=int(args.num_hidden_layers),
        num_kv_heads=int(args.num_key_value_heads),
        head_dim=family.head_dim(args),
        eos_token_ids=eos,
        is_quantized=quantized,
        family=family.model_type,
        layer_windows=windows if any(w is not None for w in windows) else (),
        weight_formats=formats or (("mlx-quantized",) if quantized else ("fp32",)),
    )


def materialize_private_arrays(model: nn.Module) -> None:
    """Evaluate arrays modules keep outside their parameters (e.g. Llama 3 RoPE's `_freqs`), now.

    Left lazy, such an array is computed on whichever thread first evaluates a graph holding
    it, with the stream of the thread that built it (the loading thread): on the engine thread
    that failed every step with "There is no Stream(cpu, 0) in current thread".
    """
    found = [v for _, m in model.named_modules() for k, v in [*m.items(), *vars(m).items()]
             if k.startswith("_") and isinstance(v, mx.array)]
    if found:
        mx.eval(found)


def load_model(path: Path) -> LoadedModel:
    """Load an mlx-lm style folder (config.json, *.safetensors, tokenizer files) offline.

    Raises:
        FileNotFoundError: the folder or its config is missing.
        ValueError: the architecture is not a llama-family model we can run.
    """
    model, config = load_weights(path, lazy=False)
    tokenizer, eos = _tokenizer(path, config)
    return LoadedModel(model, spec_of(model, path.name, eos, "quantization" in config), tokenizer)


def load_gguf_model(path: Path, cache_dir: Path | None = None, qmatmul: QMatmul | None = None) -> LoadedModel:
    """A GGUF file's model, config and tokenizer from the file alone (model/gguf_model.py).

    Args:
        cache_dir: where a built tokenizer is kept for the next start (None: built every time).
        qmatmul: the exact block kernel: serve the file's own blocks through it (model/gguf_file_blocks.py);
            None: every tensor dequantized to fp32 by gguf-py (the same bits).
    Raises:
        ValueError: an unsupported architecture or tensor type (named).
    """
    from inference_engine.model.gguf_file_blocks import build_gguf_block_model
    from inference_engine.model.gguf_model import load_gguf

    build = None if qmatmul is None else (lambda g: build_gguf_block_model(g, qmatmul))
    model, config, tokenizer = load_gguf(path, cache_dir, build)
    materialize_private_arrays(model)
    formats = tuple(config["gguf_types"])
    return LoadedModel(model, spec_of(model, path.stem, tuple(config["eos_token_id"]), formats=formats), tokenizer)


def _tokenizer(path: Path, config: dict[str, Any]) -> tuple[Any | None, tuple[int, ...]]:
    """The folder's tokenizer and EOS ids; (None, config's eos ids) for a folder without tokenizer files
    (random-weight test models)."""
    from mlx_lm.utils import load_tokenizer

    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        eos = config.get("eos_token_id")
        return None, tuple(sorted(int(t) for t in (eos if isinstance(eos, list) else [] if eos is None else [eos])))
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return tokenizer._tokenizer, tuple(sorted(int(t) for t in tokenizer.eos_token_ids))


def load_block_model(path: Path, gguf_path: Path, qmatmul: QMatmul) -> LoadedModel:
    """The model of folder `path` with the GGUF's own blocks for weights (see gguf_blocks.py).

    `path` is the folder converted from `gguf_path` (architecture, config, tokenizer); its fp32
    weights are never read.

    Raises:
        FileNotFoundError / ValueError: as `load_model`, or the GGUF does not fit the folder.
    """
    model, config = load_weights(path, lazy=True)  # the fp32 arrays stay unread: all are replaced
    load_gguf_blocks(model, gguf_path, qmatmul)
    tokenizer, eos = _tokenizer(path, config)
    return LoadedModel(model, spec_of(model, path.name, eos, formats=("F32", "Q4_1", "Q8_0")), tokenizer)


def load_weights(path: Path, lazy: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    """An mlx-lm folder's model object and config, without its tokenizer.

    Lazy weights are read when first evaluated (a shard worker materializes only its layers).

    Raises:
        FileNotFoundError: no config.json in `path`.
        ValueError: not a model family we serve (the message names those we do).
    """
    from mlx_lm.utils import load_model as mlx_lm_load_model

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an mlx-lm model folder (no config.json)")
    family_of(json.loads((path / "config.json").read_text()).get("model_type"))
    model, config = mlx_lm_load_model(path, lazy=lazy)
    if "quantization" not in config:
        widen_half_weights(model, path.name)
    materialize_private_arrays(model)
    return model, config


def widen_half_weights(model: nn.Module, name: str) -> None:
    """bf16 / fp16 parameters of an unquantized folder as fp32, in place (lazily: a shard worker still reads
    only its layers). Exact: every bf16 and fp16 value is an fp32 one. The exact kernels and the native
    block compute in fp32; the model served is then the fp32 model of the stored weights (twice their memory).
    """
    from mlx.utils import tree_flatten, tree_map

    halves = {str(v.dtype) for _, v in tree_flatten(model.parameters()) if v.dtype in (mx.bfloat16, mx.float16)}
    if not halves:
        return
    model.update(tree_map(lambda v: v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v,
                          model.parameters()))
    log.info("%s: %s weights served as fp32 (widened exactly; the exact kernels compute in fp32)", name,
             "/".join(sorted(h.removeprefix("mlx.core.") for h in halves)))


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
