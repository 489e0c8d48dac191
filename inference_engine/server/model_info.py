"""What GetModelInfo reports: the served model, its tokenizer and the server's limits."""

from __future__ import annotations

from dataclasses import dataclass

from inference_engine.serving_path import kernels_in_use
from inference_engine.config import ServerConfig
from inference_engine.decoding.logprobs import MAX_TOP_LOGPROBS
from inference_engine.model.gguf_blocks import has_blocks
from inference_engine.runtime.engine import Engine
from inference_engine.text.codec import TextCodec


@dataclass(frozen=True)
class ModelInfo:
    """The served model and what a session may ask of it."""

    model_name: str  # the model folder's name (packaged: its name and the weights served, e.g. "(GGUF Q4_1/Q8_0)")
    vocab_size: int  # token ids are below it
    eos_token_ids: tuple[int, ...]  # the model's EOS ids (a session's default)
    bos_token_id: int | None  # the tokenizer's BOS id, if any
    has_tokenizer: bool  # text, messages, stop strings, Tokenize/Detokenize are servable
    has_chat_template: bool  # messages are servable
    is_exact: bool  # the probed bit-exact path
    block_size: int  # rows per forward block
    kernels: str  # what computes the products: the exact kernels on the CPU stream, or MLX ops (serving_path.py)
    model_fingerprint: str  # hex SHA-256 of the model's shape and first embedding rows
    has_draft_model: bool  # SPECULATIVE_DRAFT is servable
    default_sink: int  # sink tokens of a session that asks for 0
    max_sink: int  # largest sink
    default_window: int  # window tokens of a session that asks for 0
    max_window: int  # largest window
    default_new_tokens: int  # max_new_tokens of a Generate that asks for 0
    max_new_tokens: int  # largest max_new_tokens
    max_tokens_per_request: int  # tokens one AppendTokens may append
    max_draft_tokens: int  # largest num_draft_tokens
    max_top_logprobs: int  # largest top_logprobs
    max_sessions: int  # sessions in the pool
    family: str = ""  # the model family (model/families/)
    weight_formats: tuple[str, ...] = ()  # "fp32", "mlx-quantized", or the GGUF's ggml types
    layer_attention: tuple[str, ...] = ()  # per layer: "global" or "sliding:N"


def engine_weights(engine: Engine) -> str:
    """What the engine's target computes with: "q4_1" (`--weights q4_1`: the GGUF's blocks, whatever their
    types) or "fp32"."""
    return "q4_1" if has_blocks(engine.loaded.model) else "fp32"


def blocks_label(formats: tuple[str, ...]) -> str:
    """The GGUF block types a model is served from, for people: "GGUF Q4_K/Q5_0/Q6_K/Q8_0" (F32 norms left out)."""
    return "GGUF " + "/".join(f for f in formats if f != "F32")


def serving_label(info: ModelInfo) -> str:
    """One line naming what serves: weights, exactness and block size, kernels (start-up log)."""
    mode = f"exact at block size {info.block_size}" if info.is_exact else f"plain blocks of {info.block_size} (not exact)"
    return f"{info.model_name}, {mode}, {info.kernels}"


def describe_model(engine: Engine, cfg: ServerConfig, codec: TextCodec | None) -> ModelInfo:
    """The ModelInfo of a server (call once at start-up: it reads the embedding rows)."""
    from inference_engine.model.loader import model_fingerprint  # the same fingerprint shard workers report

    spec = engine.spec
    name = spec.name  # the model folder's name; packaged models live in <cache>/<name>/{fp32,q4}
    if cfg.model.startswith("packaged:") and name in ("fp32", "q4"):
        # the blocks are loaded via the fp32 folder: name them by their block types, not the folder
        form = blocks_label(spec.weight_formats) if engine_weights(engine) == "q4_1" else name
        name = f"{cfg.model.removeprefix('packaged:')} ({form})"
    return ModelInfo(
        model_name=name, vocab_size=spec.vocab_size, eos_token_ids=spec.eos_token_ids,
        bos_token_id=codec.bos_token_id if codec else None, has_tokenizer=codec is not None,
        has_chat_template=bool(codec and codec.has_chat_template), is_exact=engine.is_exact,
        block_size=engine.block, kernels=kernels_in_use(), model_fingerprint=model_fingerprint(engine.loaded.model),
        has_draft_model=engine.has_draft_model, default_sink=cfg.default_sink, max_sink=cfg.max_sink,
        default_window=cfg.default_window, max_window=cfg.max_window, default_new_tokens=cfg.default_new_tokens,
        max_new_tokens=cfg.max_new_tokens, max_tokens_per_request=cfg.max_tokens_per_request,
        max_draft_tokens=cfg.max_rollback, max_top_logprobs=MAX_TOP_LOGPROBS, max_sessions=cfg.max_sessions,
        family=spec.family, weight_formats=spec.weight_formats,
        layer_attention=tuple("global" if spec.window_of(i) is None else f"sliding:{spec.window_of(i)}"
                              for i in range(spec.num_layers)),
    )
