"""The bench's llama.cpp arm: a crash of llama.cpp makes the arm unavailable with the reason, never ends the bench."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the bench's own package, as bench.py does

from benchkit.engines import PORTABLE_BUILD, probe_llama_cpp  # noqa: E402

# Fixtures standing in for llama-cpp-python: one that crashes as it did on AMX Xeons, one that fails, one that works.
SEGFAULT = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
FAILS = "import sys; sys.exit('llama_model_load: error loading model: ' + sys.argv[1])"
WORKS = "pass"


def test_a_crash_is_reported_with_the_portable_build():
    why = probe_llama_cpp(Path("m.gguf"), SEGFAULT)
    assert why.startswith("llama.cpp crashed (SIGSEGV) decoding in a probe process") and PORTABLE_BUILD in why
    assert "-DGGML_NATIVE=OFF" in PORTABLE_BUILD and "-DGGML_AVX512=ON" in PORTABLE_BUILD


def test_a_failure_is_reported_with_its_message_and_success_is_empty():
    assert probe_llama_cpp(Path("m.gguf"), FAILS) == ("llama.cpp failed in a probe process (exit 1): "
                                                      "llama_model_load: error loading model: m.gguf")
    assert probe_llama_cpp(Path("m.gguf"), WORKS) == ""
    assert "within 0.5 s" in probe_llama_cpp(Path("m.gguf"), "import time; time.sleep(30)", timeout_s=0.5)
