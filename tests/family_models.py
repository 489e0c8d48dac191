"""Tiny random-weight models of every family we serve, built by mlx-lm's own classes and saved as folders.

Each folder (config.json + model.safetensors, no tokenizer) is what a user would pass to
`serve --model PATH`; tests load it with our loader and, for reference, with mlx-lm's.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from tests.tiny_models import TINY_ARGS, random_model

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

# name -> ModelArgs overrides of TINY_ARGS (every family feature switched on at least once)
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": {"model_type": "llama"},
    "llama3": {"model_type": "llama", "rope_scaling": LLAMA3_SCALING},
    "mistral": {"model_type": "mistral"},
    "qwen2": {"model_type": "qwen2"},  # bias on q/k/v; its ModelArgs has no head_dim
    "qwen3": {"model_type": "qwen3", "head_dim": 16},  # q/k norms
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16, "rope_theta": 1e6,
                    "rope_local_base_freq": 1e4, "sliding_window": 8, "sliding_window_pattern": 2},
}


def save_family_model(name: str, folder: Path, seed: int = 0) -> Path:
    """Write family `name`'s tiny random model into `folder` (an mlx-lm folder); returns it."""
    cfg = {**TINY_ARGS, **FAMILY_CONFIGS[name]}
    overrides = {k: v for k, v in cfg.items() if k not in TINY_ARGS or TINY_ARGS[k] != v}
    loaded = random_model(seed, random_norms=True, **overrides)
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(nn.utils.tree_flatten(loaded.model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 1}))
    return folder
