"""The packaged models' list (`python -m inference_engine models`) and names `--model` refuses."""

import subprocess
import sys

import pytest

from inference_engine.model.families import supported_types
from inference_engine.model.packaged import GEMMA_MODEL, PACKAGED_MODELS, resolve_model_path


def test_models_lists_every_packaged_name_and_the_families():
    out = subprocess.run([sys.executable, "-m", "inference_engine", "models"], capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == [m.name for m in PACKAGED_MODELS]
    assert GEMMA_MODEL in out and all(t in lines[-1] for t in supported_types())


def test_an_unknown_packaged_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown packaged model 'packaged:nope'; packaged models: packaged:smollm2"):
        resolve_model_path("packaged:nope", tmp_path)
