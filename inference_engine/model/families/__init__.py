"""The model families we serve, by `model_type` (see base.py for what an adapter declares)."""

from __future__ import annotations

from typing import Any

from inference_engine.model.families import gemma3_text, llama, mistral, qwen2, qwen3
from inference_engine.model.families.base import Family

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in (llama, mistral, qwen2, qwen3, gemma3_text)}


def supported_types() -> tuple[str, ...]:
    """The `model_type`s we serve, sorted."""
    return tuple(sorted(FAMILIES))


def family_of(model_type: str | None) -> Family:
    """The adapter of `model_type`.

    Raises:
        ValueError: not a family we serve, naming the ones we do.
    """
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(supported_types())}")
    return FAMILIES[model_type]


def family_of_model(model: Any) -> Family:
    """The adapter of an mlx-lm model object (its `args.model_type`)."""
    return family_of(getattr(model.args, "model_type", None))


def family_of_gguf(arch: str) -> Family:
    """The adapter serving GGUF files of `general.architecture` `arch`.

    Raises:
        ValueError: no family reads that architecture, naming those we read.
    """
    for f in FAMILIES.values():
        if f.gguf_arch == arch:
            return f
    archs = sorted({f.gguf_arch for f in FAMILIES.values() if f.gguf_arch})
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(archs)}")
