"""`serve --model FILE.gguf` from the file's own blocks: every quantized tensor kept as stored.

The fp32 path (gguf_model.py) dequantizes every tensor with gguf-py. Here each 2-D tensor of a
type the exact kernel reads (gguf_blocks.TYPE_SIZES) stays as its raw rows of blocks, in a
`BlockLinear` (or the `BlockEmbedding`, which is the tied head too), with Q/K rows un-permuted
where the family's converter permuted them (rows of blocks move whole, as fp32 rows would);
F32 tensors and 1-D ones (norms) are fp32 arrays, as the fp32 path has them. The kernel is
bitwise the fp32 product of gguf-py's dequantization, so the model's logits are the fp32
path's bit for bit (the start-up probe checks every tensor type against the fp32 kernel).

q/k/v and gate/up are fused into one product each (fused_block.concat_linears): where a layer
mixes Q4_0/Q5_0 with Q8_0 (Q4_K_M files do: Gemma-3-270M's attn_v), the Q4_0/Q5_0 rows become
Q8_0 blocks of the very same weights (gguf_blocks.as_q8_0); other mixes (Q4_K with Q6_K) fuse
as fp32 rows of gguf-py's dequantization, bitwise the same product, so every block runs on
the native block kernel like the fp32 model's (at the memory of those rows in fp32).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from inference_engine.model.families import Family, family_of_gguf
from inference_engine.model.gguf_blocks import FORMAT_NAMES, BlockEmbedding, BlockLinear, QMatmul, _parent, row_bytes
from inference_engine.model.gguf_convert import _unpermute_rows
from inference_engine.model.gguf_model import _mlx_name, check_tensor_types, dequantize, gguf_config, mark_norms_stored
from inference_engine.model.gguf_reader import GgufFile, TensorInfo

def _is_blocks(t: TensorInfo) -> bool:
    """Served as stored: a 2-D tensor of a type the kernel reads."""
    return len(t.shape) == 2 and row_bytes(t.kind, t.shape[-1]) > 0


def build_gguf_block_model(g: GgufFile, qmatmul: QMatmul) -> tuple[nn.Module, dict[str, Any]]:
    """The file's model as an mlx-lm model object whose linears and embedding are the file's blocks.

    Raises:
        ValueError: an unsupported architecture or tensor type (named), or tensors that do not fit the config.
    """
    from mlx_lm.utils import _get_classes

    family = family_of_gguf(str(g.get("general.architecture")))
    check_tensor_types(g)
    cfg = gguf_config(g, family)
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    names = {t.name: _mlx_name(family, t.name) for t in g.tensors}
    if hasattr(model, "sanitize"):  # structural only here: drops the head of a tied model, as mlx-lm's loader does
        model.sanitize({n: None for n in names.values()})
    # Blocks first: a bias (qwen2's q/k/v) then lands on the BlockLinear that replaced its nn.Linear.
    ordered = sorted(g.tensors, key=lambda t: not _is_blocks(t))
    replaced = {_place(model, family, cfg, g, t, names[t.name], qmatmul) for t in ordered}
    missing = [k for k, _ in tree_flatten(model.parameters()) if k not in replaced]
    if missing:
        raise ValueError(f"{g.path.name} provides no tensor for {missing[:3]} ({len(missing)} parameters)")
    mx.eval(model.parameters())
    mark_norms_stored(model, family)
    return model, cfg


def _place(model: nn.Module, family: Family, cfg: dict[str, Any], g: GgufFile, t: TensorInfo, name: str,
           qmatmul: QMatmul) -> str:
    """Put tensor `t` into `model` (blocks or fp32); returns the parameter name it fills."""
    heads = {"attn_q.": cfg["num_attention_heads"], "attn_k.": cfg["num_key_value_heads"]}
    n_heads = next((h for key, h in heads.items() if f".{key}" in t.name), None) if family.gguf_permutes_qk else None
    if not _is_blocks(t):  # F32, or a 1-D tensor (norms): fp32, as the fp32 path has it
        w = dequantize(g, t)
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, mx.array(w if n_heads is None else _unpermute_rows(w, n_heads)))
        return name
    rows = int(np.prod(t.shape[:-1]))
    data = g.tensor_bytes(t).reshape(rows, -1)  # (out features, row bytes)
    if n_heads is not None:
        data = np.ascontiguousarray(_unpermute_rows(data, n_heads))
    module_path = name.rsplit(".", 1)[0]
    parent, leaf = _parent(model, module_path)
    kind = BlockEmbedding if leaf == "embed_tokens" else BlockLinear
    setattr(parent, leaf, kind(mx.array(data), t.kind, t.shape[-1], qmatmul))
    return module_path + ".blocks"


def served_types(model: nn.Module) -> tuple[str, ...]:
    """The ggml types the model's block-stored weights are multiplied in, and F32 (its norms), sorted."""
    kinds = {m.fmt for _, m in model.named_modules() if isinstance(m, (BlockLinear, BlockEmbedding))}
    return tuple(sorted({"F32", *(FORMAT_NAMES[k] for k in kinds)}))
