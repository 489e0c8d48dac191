"""A fast real draft model for the packaged target: the q4 model's weights, dequantized to fp32.

Drafts only need to come from another model (the target verifies every token), but the packaged q4
draft computes with MLX's 4-bit products, about 0.17 s a row on this 2-core machine: a draft cache
catching up on a 50-150-token prompt costs 10-25 s per session. Dequantized, the same weights run on
the exact fp32 kernels and propose the same tokens on the copy prompt (55/55 accepted either way).
The q4 model itself drafts on the real model in test_sampling_real_model.py and test_constrained.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import dequantize_model

from inference_engine.model.loader import LoadedModel, load_model


def dequantized_q4_draft(real_model_path: Path) -> LoadedModel:
    """The packaged q4 draft (next to `real_model_path`) with every weight dequantized to fp32."""
    q4 = load_model(real_model_path.parent / "q4")
    model = dequantize_model(q4.model)
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))  # its scales are fp16
    mx.eval(model.parameters())  # here, not lazily on an engine's thread
    return dataclasses.replace(q4, model=model, spec=dataclasses.replace(q4.spec, is_quantized=False))
