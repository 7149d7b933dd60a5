"""benchmarks/models.py's plumbing on the CPU: every family's tiny model builds, takes the
inputs the benchmark makes, and `real_tokens` keeps exactly the unpadded positions (the GPU
run itself needs CUDA, PyCUDA and transformers)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import ROOT

pytest.importorskip("transformers")
spec = importlib.util.spec_from_file_location("benchmark_models", ROOT / "benchmarks" / "models.py")
models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(models)
FAMILIES = ("bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma3", "phi3", "vit",
            "t5", "encoder_layer")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_builds_runs_and_keeps_its_real_tokens(family):
    model, make = models.build(family, layers=2, tiny=True)
    kwargs = make(4, 32, "cpu")
    with torch.no_grad():
        kept = models.real_tokens(model(**kwargs), kwargs)
    assert kept.shape[-1] == 128 and torch.isfinite(kept).all()
    if family == "vit":
        assert kept.dim() == 3  # no padding: every patch token and the class token
    else:  # encoders: the last quarter of the second half of the batch is padding; decoders: none
        padded = 2 * 8 if family in models.ENCODERS else 0
        assert kept.shape == (4 * 32 - padded, 128)
