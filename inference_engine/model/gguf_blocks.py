"""Serving the GGUF's own blocks: linears and the tied embedding read the stored bytes, not fp32.

The fp32 model (gguf_convert.py, gguf_model.py) is every GGUF tensor dequantized by gguf-py in
fp32 and the Q/K rows un-permuted. Here the same tensors are kept as their raw blocks (uint8
rows of blocks, one row per output feature, rows un-permuted the same way) and multiplied by a
kernel (`QMatmul`, the MLX extension of `quant_kernel.py`) that dequantizes them with gguf-py's
arithmetic and reduces in the fp32 kernel's order: the logits are bitwise those of the fp32
model, at a fraction of the bytes. Types: F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K (`TYPE_SIZES`, native/ggml_types.h). The embedding lookup dequantizes the gathered rows:
Q4_1/Q8_0 with MLX ops doing the converter's roundings, the others with gguf-py itself.
For the packaged SmolLM2 nothing of the fp32 model is kept: its folder gives the architecture,
config and tokenizer, its (lazy) weights are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.model.gguf_convert import _hf_name, _unpermute_rows
from inference_engine.model.gguf_reader import read_gguf

QMatmul = Callable[[mx.array, mx.array, int], mx.array]  # (x (..., K), blocks (N, bytes), fmt) -> (..., N)
Q4_0, Q4_1, Q5_0, Q8_0 = 2, 3, 6, 8  # ggml type ids
BLOCK = 32  # weights per block (Q4_1, Q8_0)
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
# Every type the kernel reads as stored: ggml type id -> (weights per block, bytes per block)
TYPE_SIZES = {1: (32, 64), 30: (32, 64), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), 7: (32, 24),
              Q8_0: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
FORMAT_NAMES = {1: "F16", 30: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", 7: "Q5_1", Q8_0: "Q8_0",
                12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def row_bytes(fmt: int, features: int) -> int:
    """Bytes of one row of `features` weights of ggml type `fmt`; -1 for a type not read or partial blocks."""
    if fmt not in TYPE_SIZES or features % TYPE_SIZES[fmt][0]:
        return -1
    per, size = TYPE_SIZES[fmt]
    return features // per * size


def as_q8_0(blocks: np.ndarray, fmt: int) -> np.ndarray:
    """Q4_0 / Q5_0 rows (uint8 (N, bytes)) as Q8_0 rows of bitwise the same weights.

    Both are d * float(q) with q = nibble - 8 (Q4_0) or nibble | high bit << 4, minus 16 (Q5_0):
    a Q8_0 block with the same fp16 d and int8 q dequantizes to q * d, the same single rounding
    of the same exact product. Lets q/k/v of mixed types (Q4_K_M files) fuse into one linear.
    """
    if fmt not in (Q4_0, Q5_0):
        raise ValueError(f"ggml type {fmt} has no exact Q8_0 form")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, TYPE_SIZES[fmt][1])  # (N, blocks, bytes)
    qs = b[..., -16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int16)  # (N, blocks, 32)
    if fmt == Q5_0:
        qh = b[..., 2:6].copy().view(np.uint32)  # (N, blocks, 1)
        q |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
        q -= 16
    else:
        q -= 8
    out = np.concatenate([b[..., 0:2], q.astype(np.int8).view(np.uint8)], axis=-1)  # (N, blocks, 34)
    return out.reshape(n, -1)


def dequantize_blocks(blocks: np.ndarray, fmt: int) -> np.ndarray:
    """The converter's fp32 weights of `blocks` (uint8 (N, bytes)): gguf-py's own dequantization."""
    import gguf

    return np.asarray(gguf.dequantize(blocks, gguf.GGMLQuantizationType(fmt)), dtype=np.float32)


class BlockLinear(nn.Module):
    """x @ W.T with W stored as GGUF blocks; bitwise nn.Linear over the dequantized W."""

    def __init__(self, blocks: mx.array, fmt: int, in_features: int, qmatmul: QMatmul):
        """
        Args:
            blocks: uint8 (out_features, row bytes of in_features), one row per output feature.
            fmt: ggml type id (a key of TYPE_SIZES).
            qmatmul: the kernel computing x @ dequant(blocks).T.
        """
        super().__init__()
        if row_bytes(fmt, in_features) != blocks.shape[1]:
            raise ValueError(f"blocks of shape {tuple(blocks.shape)} are not {in_features} features of ggml type {fmt}")
        self.blocks = blocks
        self.fmt = fmt
        self.in_features = in_features
        self.qmatmul = qmatmul

    @property
    def out_features(self) -> int:
        """Rows of W."""
        return int(self.blocks.shape[0])

    def __call__(self, x: mx.array) -> mx.array:
        y = self.qmatmul(x, self.blocks, self.fmt)
        return y + self["bias"] if "bias" in self else y  # a bias (qwen2's q/k/v): added once, as addmm does

    def dequantized(self) -> mx.array:
        """W in fp32 as the converter made it (the fp32 model's weight): a copy, for checks only."""
        return mx.array(dequantize_blocks(np.array(self.blocks), self.fmt))


def fuse_formats(parts: list[BlockLinear]) -> bool:
    """Give block linears to be fused one ggml type where an exact common form exists; True if they share one.

    Q4_0 / Q5_0 parts beside Q8_0 ones become Q8_0 blocks of the same weights (as_q8_0). Other
    mixes (Q4_K beside Q6_K, as Q4_K_M files of 256-divisible widths have) have none: False.
    """
    kinds = {p.fmt for p in parts}
    if len(kinds) == 1:
        return True
    if not kinds <= {Q4_0, Q5_0, Q8_0}:
        return False
    for p in parts:
        if p.fmt != Q8_0:
            p.blocks = mx.array(as_q8_0(np.array(p.blocks), p.fmt))
            p.fmt = Q8_0
    return True


class BlockEmbedding(nn.Module):
    """A (tied) embedding stored as GGUF blocks: lookup and LM head (`as_linear`)."""

    def __init__(self, blocks: mx.array, fmt: int, dims: int, qmatmul: QMatmul):
        super().__init__()
        if row_bytes(fmt, dims) != blocks.shape[1]:
            raise ValueError(f"blocks of shape {tuple(blocks.shape)} are not {dims} dims of ggml type {fmt}")
        self.blocks = blocks
        self.fmt = fmt
        self.dims = dims
        self.qmatmul = qmatmul

    def __call__(self, ids: mx.array) -> mx.array:
        """Rows `ids` dequantized: (..., dims) float32, bitwise the fp32 embedding's rows."""
        rows = self.blocks[ids]  # (..., bytes)
        if self.fmt not in BLOCK_BYTES:  # gguf-py's own dequantization of the gathered rows
            flat = np.array(rows).reshape(-1, rows.shape[-1])
            return mx.array(dequantize_blocks(flat, self.fmt).reshape(*ids.shape, self.dims))
        groups = rows.reshape(*ids.shape, self.dims // BLOCK, BLOCK_BYTES[self.fmt])  # (..., blocks, bytes)
        d = mx.view(groups[..., 0:2], mx.float16).astype(mx.float32)  # (..., blocks, 1)
        if self.fmt == Q8_0:
            q = mx.view(groups[..., 2:], mx.int8).astype(mx.float32)  # (..., blocks, 32)
            w = q * d  # gguf-py: x * d, one rounding (exact here)
        else:
            m = mx.view(groups[..., 2:4], mx.float16).astype(mx.float32)
            nibbles = groups[..., 4:]  # (..., blocks, 16): weight i low nibble, 16 + i high nibble
            q = mx.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(mx.float32)
            w = d * q + m  # two ops, two roundings (not compiled: never fused), as gguf-py's (d * qs) + m
        return w.reshape(*ids.shape, self.dims)

    def as_linear(self, x: mx.array) -> mx.array:
        """x @ E.T: the tied LM head."""
        return self.qmatmul(x, self.blocks, self.fmt)

    def dequantized(self) -> mx.array:
        """E in fp32 as the converter made it (a copy, for checks only)."""
        return mx.array(dequantize_blocks(np.array(self.blocks), self.fmt))


def has_blocks(model: nn.Module) -> bool:
    """Some of the model's weights are stored as GGUF blocks."""
    return isinstance(model.model.embed_tokens, BlockEmbedding) or any(
        isinstance(m, BlockLinear) for _, m in model.named_modules())


def _parent(model: nn.Module, path: str) -> tuple[object, str]:
    *parents, leaf = path.split(".")
    obj: object = model
    for p in parents:
        obj = obj[int(p)] if isinstance(obj, list) else getattr(obj, p)
    return obj, leaf


@dataclass(frozen=True)
class GgufTensor:
    """Where one tensor's bytes are in a GGUF file."""

    name: str  # GGUF tensor name, e.g. blk.3.attn_q.weight
    kind: int  # ggml type id (0 = F32, 3 = Q4_1, 8 = Q8_0, ...)
    shape: tuple[int, ...]  # numpy order (rows first): the reverse of GGUF's ne
    offset: int  # byte offset of the data in the file
    row_bytes: int  # bytes of one row (the last dimension)


_TYPE_SIZES = {0: (1, 4), 1: (1, 2), Q4_1: (BLOCK, BLOCK_BYTES[Q4_1]), Q8_0: (BLOCK, BLOCK_BYTES[Q8_0])}  # the folder path's


def read_gguf_tensors(path: Path) -> list[GgufTensor]:
    """The tensor directory of a GGUF file (v2/v3, little-endian): names, types, shapes, offsets,
    read with the one GGUF header reader (`gguf_reader.read_gguf`).

    Raises:
        ValueError: not a GGUF file, or a type this reader cannot size.
    """
    out = []
    for t in read_gguf(path).tensors:
        if t.kind not in _TYPE_SIZES:
            raise ValueError(f"{t.name}: ggml type {t.kind} is not one this reader can size")
        per, size = _TYPE_SIZES[t.kind]
        out.append(GgufTensor(t.name, t.kind, t.shape, t.offset, t.shape[-1] // per * size))
    return out


def load_gguf_blocks(model: nn.Module, gguf_path: Path, qmatmul: QMatmul) -> None:
    """Give `model` (an mlx-lm llama built from the converted folder) the GGUF's own tensors.

    Quantized linears become BlockLinear, the embedding BlockEmbedding, float tensors (norms)
    plain fp32 arrays; Q/K rows are un-permuted exactly as the converter did.

    Raises:
        ValueError: a tensor type other than F32/Q4_1/Q8_0, a tensor the model does not have,
            or a model parameter the GGUF does not provide.
    """
    args = model.args
    heads = {"attn_q": int(args.num_attention_heads), "attn_k": int(args.num_key_value_heads)}
    replaced: set[str] = set()
    for t in read_gguf_tensors(gguf_path):
        name = _hf_name(t.name)  # e.g. model.layers.3.self_attn.q_proj.weight
        n_heads = next((n for key, n in heads.items() if f".{key}." in t.name), None)
        rows = int(np.prod(t.shape[:-1]))
        data = np.fromfile(gguf_path, np.uint8, rows * t.row_bytes, offset=t.offset).reshape(rows, t.row_bytes)
        if t.kind == 0:  # F32 (norms): as they are
            parent, leaf = _parent(model, name)
            setattr(parent, leaf, mx.array(data.view(np.float32).reshape(t.shape)))
            replaced.add(name)
            continue
        if t.kind not in BLOCK_BYTES:
            raise ValueError(f"{t.name} has ggml type {t.kind}; serving blocks supports Q4_1, Q8_0 and F32 tensors")
        if n_heads is not None:
            data = _unpermute_rows(data, n_heads)  # (out features, bytes) in the converter's row order
        module_path = name.rsplit(".", 1)[0]
        parent, leaf = _parent(model, module_path)
        kind = BlockEmbedding if leaf == "embed_tokens" else BlockLinear
        setattr(parent, leaf, kind(mx.array(data), t.kind, t.shape[-1], qmatmul))
        replaced.add(module_path + ".blocks")
    from mlx.utils import tree_flatten

    missing = [k for k, _ in tree_flatten(model.parameters()) if k not in replaced]
    if missing:
        raise ValueError(f"the GGUF provides no tensor for {missing[:3]} ({len(missing)} parameters)")
    mx.eval(model.parameters())
