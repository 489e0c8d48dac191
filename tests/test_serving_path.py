"""Which arithmetic a process reports: the exact kernels, MLX ops with the BLAS it maps, or Metal."""

import mlx.core as mx
import pytest

from inference_engine import serving_path
from inference_engine.model import native_kernels
from tests.kernel_guard import is_kernel_bound


def test_this_run_reports_the_exact_kernels():
    if not is_kernel_bound():
        pytest.skip("the exact kernels compute this run's products on Linux only (conftest)")
    assert serving_path.kernels_in_use().startswith("exact-gemm kernel 3 (")
    assert serving_path.is_exact_native()


def test_without_the_product_primitive_it_reports_mlx_ops(monkeypatch):
    bound = native_kernels.bound()
    attention_only = native_kernels.NativeKernels(bound.attend, None) if bound else None
    monkeypatch.setattr(native_kernels, "_bound", attention_only)
    monkeypatch.setattr(serving_path, "active_blas", lambda: "reference: MLX bundled")
    expected = "MLX ops (native attention), BLAS reference: MLX bundled" if bound else "MLX ops, BLAS reference: MLX bundled"
    assert serving_path.kernels_in_use() == expected and not serving_path.is_exact_native()
    monkeypatch.setattr(native_kernels, "_bound", None)
    assert serving_path.kernels_in_use() == "MLX ops, BLAS reference: MLX bundled"
    monkeypatch.setattr(serving_path.mx, "default_device", lambda: mx.gpu)
    assert serving_path.kernels_in_use() == "MLX ops on Metal"


def test_macos_exact_moves_to_the_cpu_stream_plain_stays_on_metal(monkeypatch):
    calls = []
    monkeypatch.setattr(serving_path.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(serving_path.mx, "set_default_device", calls.append)
    serving_path.use_cpu_stream(exact=False, platform="darwin")
    serving_path.use_cpu_stream(exact=True, platform="linux")
    assert calls == []
    serving_path.use_cpu_stream(exact=True, platform="darwin")
    assert calls == [mx.cpu]
