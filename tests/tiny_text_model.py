"""A tiny mlx-lm folder for tests that start real processes: a 2-layer random llama over the packaged tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tests.tiny_models import random_model

TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)


def write_tiny_text_model(out: Path, real_model_path: Path) -> Path:
    """Write the folder (weights, config, the packaged model's tokenizer files) to `out`; returns it."""
    vocab = json.loads((real_model_path / "config.json").read_text())["vocab_size"]
    model = random_model(seed=0, vocab_size=vocab)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**TINY, "vocab_size": vocab}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_model_path / name, out / name)
    return out
