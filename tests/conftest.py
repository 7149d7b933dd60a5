"""Shared fixtures and the skip rules: `gpu` tests need CUDA and PyCUDA, `nvcc` tests need nvcc."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _gpu_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("pycuda") is not None


if _gpu_available():
    # torch.export and torch.compile import torch._dynamo, and through it triton and its backends,
    # on first use. On the lent GPU machine those imports, when they came after PyCUDA had run
    # kernels in the same process, failed now and then with "source code string cannot contain
    # null bytes" (triton/backends/amd/compiler.py, 2026-11-24); the files read clean in a fresh
    # process; numpy.testing (which transformers reaches through scipy) failed the same way.
    # Importing them before any test runs a kernel sidesteps it.
    import numpy.testing  # noqa: F401
    import torch._dynamo  # noqa: F401
    import triton.backends  # noqa: F401

    if importlib.util.find_spec("scipy") is not None:
        import scipy.sparse  # noqa: F401  (transformers' models import it)
    if importlib.util.find_spec("transformers") is not None:
        import transformers  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU with PyCUDA")
    skip_nvcc = pytest.mark.skip(reason="needs nvcc on PATH")
    has_gpu, has_nvcc = _gpu_available(), shutil.which("nvcc") is not None
    for item in items:
        if "nvcc" in item.keywords:  # nvcc takes seconds a kernel: make test runs these in its second phase
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "nvcc" in item.keywords and not has_nvcc:
            item.add_marker(skip_nvcc)


@pytest.fixture
def example_path():
    """`example_path("tiny_bert")` -> 'examples/tiny_bert.py:factory' as an absolute reference."""
    return lambda name, factory="factory": f"{EXAMPLES / (name + '.py')}:{factory}"


@pytest.fixture
def half_on_gpu(example_path):
    """An example's module and positional inputs moved to the GPU in fp16."""
    from stof_cc.loading import load_factory

    def load(name: str):
        module, args, _ = load_factory(example_path(name))
        return module.cuda().half(), tuple(a.cuda().half() for a in args)

    return load


@pytest.fixture
def norm_merges_win(monkeypatch):
    """Price gemm_layernorm's norm epilogue at 0 us, so stage 1 merges GEMM + LayerNorm in the
    small test models: with the fitted constant (8 us, `pricing.ROW_EXCHANGE_US`) they are
    kept apart there, and tests of the merged scheme would test nothing."""
    monkeypatch.setattr("stof_cc.templates.gemm_layernorm.ROW_EXCHANGE_US", 0.0)
