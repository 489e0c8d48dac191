"""Which weights a process serves: `--weights fp32` (the converted folder) or `q4_1` (the GGUF's own blocks).

Both give bitwise the same logits (model/gguf_blocks.py, quant_kernel.py); q4_1 streams 97 MB
of blocks per token instead of 538 MB of fp32 and keeps no fp32 copy. q4_1 needs a GGUF (the
file the packaged SmolLM2 was converted from, or `--model FILE.gguf` / packaged:gemma3-270m,
whose blocks of every type are served as stored: model/gguf_file_blocks.py) and the exact
block kernel; where either is missing the process serves fp32 and says why in its log. The start-up probe then checks the
kernel against the fp32 kernel on every shape (execution/tile_probe.py); the server falls
back to fp32 if it differs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from inference_engine.malloc_trim import fix_malloc_thresholds, trim_free_memory
from inference_engine.model.loader import LoadedModel, load_block_model, load_gguf_model, load_model
from inference_engine.model.packaged import DEFAULT_MODEL, packaged_gguf_path, resolve_model_path
from inference_engine.quant_kernel import enable_native_kernels, load_quant_kernel

WEIGHTS = ("q4_1", "fp32")  # the choices of --weights (the first is the default)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """A loaded target model and the weights it is served from."""

    loaded: LoadedModel  # the model
    weights: str  # "q4_1" or "fp32": what it actually computes with
    note: str  # why it is not the requested weights ("" when it is)


def gguf_source(model: str) -> Path | None:
    """The GGUF whose blocks `--model` was converted from, if known (the packaged model only)."""
    return packaged_gguf_path() if model == DEFAULT_MODEL else None


def q4_1_unavailable(model: str, cache_dir: Path) -> str:
    """Why `model` cannot be served from q4_1 blocks in this process ("" if it can)."""
    if gguf_source(model) is None and not is_gguf_file(resolve_model_path(model, cache_dir)):
        return (f"q4_1 serves a GGUF's own blocks ({DEFAULT_MODEL}'s, or a .gguf file's); the folder --model {model} "
                "is served from fp32")
    kernel = load_quant_kernel(cache_dir)
    return kernel if isinstance(kernel, str) else ""


def load_served_model(model: str, weights: str, cache_dir: Path) -> ServedModel:
    """Load `model` from the requested weights, or from fp32 when q4_1 is unavailable here.

    Raises:
        ValueError: `weights` is not one of WEIGHTS; the model cannot be loaded.
        FileNotFoundError: the model folder is missing.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"--weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    use_native_kernels(cache_dir)
    note = q4_1_unavailable(model, cache_dir) if weights == "q4_1" else ""
    if weights == "q4_1" and not note and gguf_source(model) is None:  # a GGUF file: its blocks as stored
        path = resolve_model_path(model, cache_dir)
        kernel = load_quant_kernel(cache_dir)
        assert not isinstance(kernel, str)
        log.info("loading %s: config and tokenizer from the GGUF, its blocks served as stored", path)
        return ServedModel(load_gguf_model(path, cache_dir, kernel.qmatmul), "q4_1", "")
    if weights == "q4_1" and not note:
        return ServedModel(load_q4_1_model(model, cache_dir), "q4_1", "")
    if note:
        log.warning("DEGRADED: serving fp32 weights, not the GGUF's blocks (same bits, about 5x the memory read per token, "
                    "slower): %s", note)
    path = resolve_model_path(model, cache_dir)
    if is_gguf_file(path):
        log.info("loading %s: config, tokenizer and weights from the GGUF (gguf-py's fp32 dequantization)", path)
        return ServedModel(load_gguf_model(path, cache_dir), "fp32", note)
    log.info("loading model from %s (fp32)", path)
    return ServedModel(load_model(path), "fp32", note)


def is_gguf_file(path: Path) -> bool:
    """`path` is a GGUF file (served from its own metadata), not an mlx-lm folder."""
    return path.suffix == ".gguf" and path.is_file()


def use_native_kernels(cache_dir: Path) -> None:
    """Compute blocks with the native kernels in this process where it can (model/native_kernels.py)."""
    reason = enable_native_kernels(cache_dir)
    if reason:
        log.warning("DEGRADED: transformer blocks run as MLX ops, without the native attention and block "
                    "kernels (same bits, slower): %s", reason)


def load_q4_1_model(model: str, cache_dir: Path) -> LoadedModel:
    """`model` served from its GGUF's blocks (call only where `q4_1_unavailable` is "")."""
    kernel = load_quant_kernel(cache_dir)
    gguf = gguf_source(model)
    assert not isinstance(kernel, str) and gguf is not None, "q4_1 is unavailable here"
    path = resolve_model_path(model, cache_dir)
    log.info("loading %s as its GGUF's Q4_1/Q8_0 blocks (%s), architecture and tokenizer from %s", model, gguf, path)
    return load_block_model(path, gguf, kernel.qmatmul)


def release_start_up_memory() -> None:
    """Give the OS back what start-up freed (conversions, probe temporaries): MLX's buffer cache, then
    glibc's free lists (malloc_trim; tens of MB that would otherwise count as the idle server's RSS); from now
    on, buffers of 1 MiB and more are mapped on their own, so large transient ones leave no heap behind."""
    mx.clear_cache()
    fix_malloc_thresholds()
    trim_free_memory()
