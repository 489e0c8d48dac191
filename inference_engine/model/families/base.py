"""What a model family changes in a transformer block, declared as data (one adapter per family).

The forward path (`forward.py`, `fused_block.py`), the native block plan, the loaders and the
shard worker read a `Family`; none of them branches on a family's name. A family module
(`llama.py`, `qwen3.py`, ...) builds one `Family` and, where the model has them, says which
layers attend to a sliding window of their own.

Norms are read as *effective* weights: a `1 + w` family's weights are computed once, in fp32,
at build time (`1.0 + w` rounds exactly as mlx-lm's own call does), so the arithmetic after it
is the same for every family, native or MLX ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP gates the block kernels compute


@dataclass(frozen=True)
class Family:
    """One model family's differences from a plain llama block (mlx-lm's module names)."""

    model_type: str  # mlx-lm / HF `model_type`
    activation: str = "silu"  # the MLP gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, gelu_approx)
    norm_offset: float = 0.0  # RMSNorm multiplies by `norm_offset + w` (Gemma: 1)
    qk_norm: bool = False  # q and k heads are RMS-normed before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # attention and MLP outputs are normed before the residual (Gemma 3)
    embed_scale: Callable[[Any], float] | None = None  # hidden states after the embedding x this (args -> scale)
    logit_softcap_arg: str | None = None  # ModelArgs field of a final logit soft-cap (cap * tanh(x / cap))
    layer_window: Callable[[Any, int], int | None] = field(default=lambda args, i: None)
    # (args, layer) -> the layer's sliding window (keys it sees, itself included), None: global
    gguf_arch: str = ""  # `general.architecture` of this family's GGUF files ("" none)
    gguf_names: tuple[tuple[str, str], ...] = ()  # GGUF block tensor name -> mlx-lm name, beyond llama's
    gguf_norms_plus_one: bool = False  # llama.cpp stored `1 + w` for the norms
    gguf_permutes_qk: bool = False  # llama.cpp permuted Q/K rows (interleaved RoPE): undo on load
    gguf_config: Callable[[Callable[[str, Any], Any]], dict] | None = None
    # (metadata getter of `<arch>.<key>`, default) -> this family's config fields beyond the common ones

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")

    def head_dim(self, args: Any) -> int:
        """Per-head width: the config's `head_dim` where it has one (qwen2's ModelArgs has none)."""
        return int(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)

    def embedding_scale(self, args: Any) -> float | None:
        """The factor the embedding's rows are multiplied by (None: not scaled)."""
        return None if self.embed_scale is None else float(self.embed_scale(args))

    def logit_softcap(self, args: Any) -> float | None:
        """The final logits' soft-cap, if the model has one."""
        cap = getattr(args, self.logit_softcap_arg, None) if self.logit_softcap_arg else None
        return float(cap) if cap else None

    def windows(self, args: Any) -> tuple[int | None, ...]:
        """Every layer's sliding window (None: a global layer)."""
        return tuple(self.layer_window(args, i) for i in range(int(args.num_hidden_layers)))

    def norm_weight(self, norm: nn.Module, stored_effective: bool = False) -> mx.array:
        """The weight a norm module multiplies by (fp32, evaluated).

        Args:
            stored_effective: the weight already holds `norm_offset + w` (a GGUF's norms).
        """
        w = norm.weight
        if self.norm_offset and not stored_effective:
            w = self.norm_offset + w  # fp32, one rounding: what mlx-lm computes at every call
        mx.eval(w)
        return w


def bf16_sqrt_hidden(args: Any) -> float:
    """sqrt(hidden) rounded to bfloat16, as Gemma's embedding scale is (mlx-lm, transformers)."""
    return mx.array(args.hidden_size**0.5, mx.bfloat16).astype(mx.float32).item()
