"""A transformer block as three compiled pieces over fused projections.

On the CPU a decode step is dominated by dispatching small ops, not by arithmetic: RoPE and
RMSNorm run as a dozen elementwise ops each, and every linear is its own BLAS call. So:

- q/k/v and gate/up each become one matmul over weights concatenated along the output
  dimension; the original modules keep views into the fused arrays (no extra memory, and
  every output column is still the same dot product);
- norm + q/k/v + RoPE, the attention core, and o_proj + MLP are `mx.compile`d functions
  shared by every block of the same shape (weights are inputs, not constants), so their
  elementwise tails run as a few fused kernels.

Every piece acts on each row independently, so row-invariance (the exact path) is kept;
the tile probe covers the fused shapes (`fused_linears`). Linears stored as GGUF blocks
(`gguf_blocks.BlockLinear`) fuse the same way: their rows of blocks are concatenated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.model.families import Family, family_of_model
from inference_engine.model.gguf_blocks import BlockLinear, QMatmul, fuse_formats
from inference_engine.model import native_kernels
from inference_engine.model.native_kernels import BlockPlan

_QUANT_ARRAYS = ("weight", "scales", "biases")  # nn.QuantizedLinear's arrays, all (out, ...)


@dataclass(frozen=True)
class LinearKind:
    """Static facts of a linear (part of the compiled pieces' cache key)."""

    quant: tuple[int, int, str] | None  # (group_size, bits, mode) of a quantized linear, else None
    has_biases: bool  # a quantized linear's affine `biases` array is present
    has_bias: bool  # an additive bias follows the matmul
    blocks: tuple[int, QMatmul] | None = None  # (ggml type, kernel) of a BlockLinear, else None
    matmul: Callable[[mx.array, mx.array], mx.array] | None = None  # fp32: the exact product primitive, else None

    @property
    def n_arrays(self) -> int:
        """How many arrays `linear_arrays` yields for this kind."""
        if self.blocks is not None:
            return 1 + int(self.has_bias)
        return (1 if self.quant is None else 2 + int(self.has_biases)) + int(self.has_bias)


def linear_kind(module: nn.Module) -> LinearKind:
    """The static facts of an nn.Linear / nn.QuantizedLinear / BlockLinear."""
    if isinstance(module, BlockLinear):
        return LinearKind(None, False, "bias" in module, (module.fmt, module.qmatmul))
    quant = (module.group_size, module.bits, module.mode) if isinstance(module, nn.QuantizedLinear) else None
    is_fp32 = quant is None and module.weight.dtype == mx.float32
    matmul = native_kernels.exact_matmul() if is_fp32 else None  # fp32: the process's exact product
    return LinearKind(quant, quant is not None and "biases" in module, "bias" in module, matmul=matmul)


def _array_names(module: nn.Module) -> tuple[str, ...]:
    """The names of the arrays `apply_linear` takes, in order: weight[, scales[, biases]][, bias] or blocks."""
    if isinstance(module, BlockLinear):
        return ("blocks", "bias") if "bias" in module else ("blocks",)
    names = _QUANT_ARRAYS if isinstance(module, nn.QuantizedLinear) else ("weight",)
    return tuple(n for n in (*names, "bias") if n in module)


def linear_arrays(module: nn.Module) -> tuple[mx.array, ...]:
    """The arrays `apply_linear` takes: weight[, scales[, biases]][, bias], or a BlockLinear's blocks."""
    return tuple(module[n] for n in _array_names(module))


def apply_linear(kind: LinearKind, x: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
    """Exactly what nn.Linear / nn.QuantizedLinear / BlockLinear compute (same ops, so the same bits)."""
    if kind.blocks is not None:
        fmt, qmatmul = kind.blocks
        y = qmatmul(x, arrays[0], fmt)
        return y + arrays[1] if kind.has_bias else y
    if kind.matmul is not None:  # fp32 on the exact kernel: bias added after, as the native block does
        y = kind.matmul(x, arrays[0])
        return y + arrays[1] if kind.has_bias else y
    if kind.quant is None:
        return mx.addmm(arrays[1], x, arrays[0].T) if kind.has_bias else x @ arrays[0].T
    group_size, bits, mode = kind.quant
    y = mx.quantized_matmul(x, arrays[0], scales=arrays[1], biases=arrays[2] if kind.has_biases else None,
                            transpose=True, group_size=group_size, bits=bits, mode=mode)
    return y + arrays[-1] if kind.has_bias else y


def head_logits(model: nn.Module, h: mx.array) -> mx.array:
    """The LM head's product h @ E.T (tied embedding) or lm_head(h), fp32 weights on the exact kernel when bound.

    Args:
        h: (..., hidden) normed hidden states. Returns (..., vocab) logits before any soft-cap.
    """
    embed = model.model.embed_tokens
    if "lm_head" in model:
        head = model.lm_head
        return apply_linear(linear_kind(head), h, linear_arrays(head)) if type(head) is nn.Linear else head(h)
    matmul = native_kernels.exact_matmul() if type(embed) is nn.Embedding and embed.weight.dtype == mx.float32 else None
    return embed.as_linear(h) if matmul is None else matmul(h, embed.weight)


def concat_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear whose output is the parts' outputs side by side; the parts become views of it.

    Block linears of types without a common exact form (or beside fp32 linears, as a GGUF may store
    some tensors F32) fuse as fp32 rows of gguf-py's dequantization (the fp32 kernel's product is
    bitwise theirs), so the block still runs natively; their blocks stay.
    """
    blocks = [isinstance(p, BlockLinear) for p in parts]
    if any(blocks) and not (all(blocks) and fuse_formats(parts)):  # mixed types, or blocks beside fp32 parts
        bias = "bias" in parts[0]
        weights = [p.dequantized() if isinstance(p, BlockLinear) else p.weight for p in parts]  # (out, in) fp32
        fused = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=bias)
        fused.weight = mx.concatenate(weights, axis=0)
        if bias:
            fused.bias = mx.concatenate([p["bias"] for p in parts])
        mx.eval(fused.parameters())
        return fused
    fused = copy.copy(parts[0])
    names = _array_names(parts[0])
    for n in names:
        fused[n] = mx.concatenate([p[n] for p in parts], axis=0)
    mx.eval([fused[n] for n in names])
    start = 0
    for p in parts:
        rows = p[names[0]].shape[0]
        for n in names:
            p[n] = fused[n][start : start + rows]  # a view: the separate copy is freed
        start += rows
    mx.eval([p[n] for p in parts for n in names])
    return fused


@dataclass(frozen=True)
class RopeSpec:
    """A layer's RoPE as mx.fast.rope takes it (read from the layer's own module, whatever the family)."""

    dims: int  # rotated features per head
    traditional: bool  # interleaved pairs (else half-split)
    base: float | None  # frequency base; None: the frequencies are the `freqs` array
    scale: float  # position scale (linear rope_scaling)
    has_freqs: bool  # a frequency table (Llama 3 rope_scaling) is passed as an input


def rope_of(module: nn.Module) -> tuple[RopeSpec, mx.array | None]:
    """The RoPE of an mlx-lm rope module and its frequency table (evaluated here, on the loading thread).

    Raises:
        ValueError: a RoPE variant the block pieces do not compute (e.g. YaRN's magnitude scale).
    """
    if type(module) is nn.RoPE:
        return RopeSpec(int(module.dims), bool(module.traditional), float(module.base), float(module.scale), False), None
    freqs = getattr(module, "_freqs", None)
    if type(module).__name__ == "Llama3RoPE" and freqs is not None:
        mx.eval(freqs)
        return RopeSpec(int(module.dims), bool(module.traditional), None, 1.0, True), freqs
    raise ValueError(f"RoPE variant {type(module).__name__} is not supported (plain, linear and llama3 are)")


@dataclass(frozen=True)
class _Shape:
    """What the compiled pieces close over: one set of pieces per distinct value."""

    n_heads: int  # query heads
    n_kv: int  # K/V heads
    head_dim: int  # per-head width
    eps: float  # the block's RMSNorm epsilon (every norm of a block shares it)
    scale: float  # attention score scale
    rope: RopeSpec  # the layer's RoPE
    qk_norm: bool  # q/k heads normed before RoPE (two norm weights after the q/k/v arrays)
    sandwich: bool  # attention and MLP outputs normed before the residual
    activation: str  # "silu" or "gelu_tanh"
    kinds: tuple[LinearKind, LinearKind, LinearKind, LinearKind]  # qkv, o_proj, gate_up, down_proj


Pieces = tuple[Callable[..., tuple[mx.array, mx.array, mx.array]], Callable[..., mx.array], Callable[..., mx.array]]
_PIECES: dict[_Shape, Pieces] = {}


def _gate(activation: str, gate: mx.array, up: mx.array) -> mx.array:
    return (nn.silu(gate) if activation == "silu" else nn.gelu_approx(gate)) * up


def _pieces(s: _Shape) -> Pieces:
    """The compiled (pre, core, post) for blocks of shape `s` (traced once per input shape)."""
    if s in _PIECES:
        return _PIECES[s]
    n_q, n_kv, d, r = s.n_heads, s.n_kv, s.head_dim, s.rope
    k_qkv, k_o, k_gu, k_down = s.kinds

    def pre(h: mx.array, positions: mx.array, norm_w: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        length = h.shape[1]
        qkv_w, arrays = arrays[: k_qkv.n_arrays], arrays[k_qkv.n_arrays :]
        x = mx.fast.rms_norm(h, norm_w, s.eps)  # (1, L, hidden)
        # Each row is its own RoPE batch entry at its own global position, so rows of
        # different sessions share one call (same bits as a call per row: checked in tests).
        qkv = apply_linear(k_qkv, x, qkv_w).reshape(length, n_q + 2 * n_kv, 1, d)  # (L, heads, 1, D)
        qk = qkv[:, : n_q + n_kv]
        if s.qk_norm:  # per head, before RoPE
            qk = mx.concatenate([mx.fast.rms_norm(qk[:, :n_q], arrays[0], s.eps),
                                 mx.fast.rms_norm(qk[:, n_q:], arrays[1], s.eps)], axis=1)
            arrays = arrays[2:]
        freqs = arrays[0] if r.has_freqs else None
        qk = mx.fast.rope(qk, r.dims, traditional=r.traditional, base=r.base, scale=r.scale, offset=positions,
                          freqs=freqs)  # q and k heads rotated in one call
        q = (qk[:, :n_q, 0] * s.scale).reshape(length, n_kv, n_q // n_kv, d)  # (L, n_kv, rep, D)
        return q, qk[:, n_q:, 0].transpose(1, 0, 2), qkv[:, n_q + n_kv :, 0].transpose(1, 0, 2)  # q; k, v (n_kv, L, D)

    def core(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> mx.array:
        # One small matmul per (row, kv head) over a key prefix fixed by the row's position,
        # so a row's bits never depend on the block it came in.
        scores = q @ keys.transpose(0, 2, 1)[None]  # (l, n_kv, rep, E)
        scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=scores.dtype))
        weights = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True))  # row-local softmax
        return (weights / mx.sum(weights, axis=-1, keepdims=True)) @ values[None]  # (l, n_kv, rep, D)

    def post(h: mx.array, attn: mx.array, *arrays: mx.array) -> mx.array:
        length = h.shape[1]
        o_w, arrays = arrays[: k_o.n_arrays], arrays[k_o.n_arrays :]
        y = apply_linear(k_o, attn.reshape(1, length, n_q * d), o_w)  # (1, L, hidden)
        if s.sandwich:
            y, arrays = mx.fast.rms_norm(y, arrays[0], s.eps), arrays[1:]
        h = h + y
        norm_w, gu_w, arrays = arrays[0], arrays[1 : 1 + k_gu.n_arrays], arrays[1 + k_gu.n_arrays :]
        gate, up = mx.split(apply_linear(k_gu, mx.fast.rms_norm(h, norm_w, s.eps), gu_w), 2, axis=-1)
        y = apply_linear(k_down, _gate(s.activation, gate, up), arrays[: k_down.n_arrays])
        if s.sandwich:
            y = mx.fast.rms_norm(y, arrays[k_down.n_arrays], s.eps)
        return h + y

    _PIECES[s] = (mx.compile(pre), mx.compile(core), mx.compile(post))
    return _PIECES[s]


@dataclass(frozen=True)
class FusedBlock:
    """One transformer block's arrays and its compiled pieces."""

    pre: Callable[..., tuple[mx.array, mx.array, mx.array]]  # (h, positions, *pre_arrays) -> q, k, v
    core: Callable[..., mx.array]  # (q, keys, values, mask) -> attention rows before o_proj
    post: Callable[..., mx.array]  # (h, attn, *post_arrays) -> the block's output
    pre_arrays: tuple[mx.array, ...]  # input norm weight, fused q/k/v arrays[, q norm, k norm][, RoPE freqs]
    post_arrays: tuple[mx.array, ...]  # o_proj arrays[, its norm], MLP norm, gate/up arrays, down arrays[, its norm]
    qkv: nn.Module  # the fused q/k/v linear (probed for row-invariance)
    gate_up: nn.Module  # the fused gate/up linear (probed)
    plan: BlockPlan | None = None  # for the native whole-block kernel; None: a block it does not compute
    not_native: str = ""  # why `plan` is None ("" when it is not)


def _plan(s: _Shape, norms: tuple[mx.array, mx.array], extra_norms: tuple[mx.array, ...], freqs: mx.array | None,
          qkv: nn.Module, o_proj: nn.Module, gate_up: nn.Module, down: nn.Module) -> tuple[BlockPlan | None, str]:
    """The native block's view of this block if it computes it, else (None, why not).

    Args:
        extra_norms: the q and k norms (qk_norm), then the attention and MLP output norms (sandwich).
        freqs: the RoPE frequency table (mx.fast.rope's `freqs`: periods), if the layer has one.
    """
    formats = []
    for i, kind in enumerate(s.kinds):
        if kind.blocks is not None:
            formats.append(kind.blocks[0])
        elif kind.quant is None and (not kind.has_bias or i == 0):  # a bias on q/k/v only
            formats.append(0)
        else:
            return None, "an MLX-quantized linear or a bias outside q/k/v"
    qkv_arrays = linear_arrays(qkv)
    bias = qkv_arrays[1:] if s.kinds[0].has_bias else ()
    table = ()
    if freqs is not None:  # the kernel takes inverse frequencies: 1 / period, in double, rounded once
        table = (mx.array((1.0 / np.array(freqs, dtype=np.float64)).astype(np.float32)),)
    weights = (norms[0], qkv_arrays[0], *linear_arrays(o_proj), norms[1], *linear_arrays(gate_up),
               *linear_arrays(down), *bias, *extra_norms, *table)
    hidden, inter = int(weights[0].shape[0]), int(weights[4].shape[0]) // 2
    flags = (int(bool(bias)), int(s.qk_norm), int(s.sandwich), int(s.activation == "gelu_tanh"), int(bool(table)))
    plan = BlockPlan(
        weights=weights,
        ints=(s.n_heads, s.n_kv, s.head_dim, hidden, inter, s.rope.dims, int(s.rope.traditional), *formats, *flags),
        floats=(s.eps, s.eps, s.scale, s.rope.base or 0.0, s.rope.scale),
    )
    return plan, ""


def fused_block(layer: nn.Module, family: Family) -> FusedBlock:
    """The block's FusedBlock, built (and its projections fused) on first use."""
    block = layer.__dict__.get("_fused_block")
    if block is None:
        block = _build(layer, family)
        layer.__dict__["_fused_block"] = block  # a plain attribute, not a model parameter
    return block


def _build(layer: nn.Module, family: Family) -> FusedBlock:
    a, m = layer.self_attn, layer.mlp
    qkv = concat_linears([a.q_proj, a.k_proj, a.v_proj])
    gate_up = concat_linears([m.gate_proj, m.up_proj])
    rope, freqs = rope_of(a.rope)
    stored = bool(layer.__dict__.get("_norms_effective", False))  # a GGUF's norms hold offset + w already

    def norm(module: nn.Module) -> mx.array:
        return family.norm_weight(module, stored)

    shape = _Shape(
        n_heads=a.n_heads, n_kv=a.n_kv_heads, head_dim=linear_arrays(a.q_proj)[0].shape[0] // a.n_heads,
        eps=float(layer.input_layernorm.eps), scale=float(a.scale), rope=rope, qk_norm=family.qk_norm,
        sandwich=family.sandwich_norms, activation=family.activation,
        kinds=(linear_kind(qkv), linear_kind(a.o_proj), linear_kind(gate_up), linear_kind(m.down_proj)),
    )
    if family.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output
        attn_out, mlp_in, mlp_out = (norm(layer.post_attention_layernorm), norm(layer.pre_feedforward_layernorm),
                                     norm(layer.post_feedforward_layernorm))
    else:
        attn_out, mlp_in, mlp_out = None, norm(layer.post_attention_layernorm), None
    qk_norms = (norm(a.q_norm), norm(a.k_norm)) if family.qk_norm else ()
    norm_in = norm(layer.input_layernorm)
    pre, core, post = _pieces(shape)
    extra = (*qk_norms, *(() if attn_out is None else (attn_out, mlp_out)))
    plan, why = _plan(shape, (norm_in, mlp_in), extra, freqs, qkv, a.o_proj, gate_up, m.down_proj)
    return FusedBlock(
        pre, core, post,
        pre_arrays=(norm_in, *linear_arrays(qkv), *qk_norms, *(() if freqs is None else (freqs,))),
        post_arrays=(*linear_arrays(a.o_proj), *(() if attn_out is None else (attn_out,)), mlp_in,
                     *linear_arrays(gate_up), *linear_arrays(m.down_proj), *(() if mlp_out is None else (mlp_out,))),
        qkv=qkv, gate_up=gate_up, plan=plan, not_native=why,
    )


def fused_linears(model: nn.Module) -> list[nn.Module]:
    """The fused q/k/v and gate/up linears of the first block (every block has the same shapes)."""
    block = fused_block(model.model.layers[0], family_of_model(model))
    return [block.qkv, block.gate_up]
