"""Tiny random-weight models for unit tests (test helper: nothing outside tests/ may import it)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from inference_engine.model.families import family_of
from inference_engine.model.loader import LoadedModel, materialize_private_arrays, spec_of

TINY_ARGS = dict(  # every family's tiny test model: 2 layers, hidden 64, vocab 256
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    rms_norm_eps=1e-5, vocab_size=256, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=4096,
)


def random_model(seed: int = 0, model_type: str = "llama", random_norms: bool = False, **overrides: Any) -> LoadedModel:
    """A tiny random-weight model of a family, built by mlx-lm's own model class (no tokenizer).

    Args:
        seed: MLX random seed for the weights.
        model_type: the family (`families.FAMILIES`).
        random_norms: draw every norm's gain from [0.5, 1.5) (else mlx-lm's init: gain 1).
        overrides: ModelArgs fields to change from the tiny defaults (`TINY_ARGS`).
    """
    from mlx_lm.utils import _get_classes

    family_of(model_type)
    fields: dict[str, Any] = {**TINY_ARGS, "model_type": model_type, **overrides}
    model_class, args_class = _get_classes(fields)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(fields))
    # Default init leaves norms at 1 and is too tame; scale weights so logits spread.
    params = nn.utils.tree_map(lambda p: p * 2.0, model.parameters())
    if random_norms:  # gains in [0.5, 1.5) whatever the norm form (`w` or `1 + w`)
        offset = family_of(model_type).norm_offset
        params = nn.utils.tree_unflatten([(k, mx.random.uniform(0.5, 1.5, v.shape) - offset if "norm" in k else v)
                                          for k, v in nn.utils.tree_flatten(params)])
    model.update(params)
    mx.eval(model.parameters())
    materialize_private_arrays(model)
    return LoadedModel(model, spec_of(model, f"random-{seed}", (1,), False), None)
