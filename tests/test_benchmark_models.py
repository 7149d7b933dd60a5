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
    model, make = models.build(family, layers=2, size="tiny")
    kwargs = make(4, 32, "cpu")
    with torch.no_grad():
        kept = models.real_tokens(model(**kwargs), kwargs)
    assert kept.shape[-1] == 128 and torch.isfinite(kept).all()
    if family == "vit":
        assert kept.dim() == 3  # no padding: every patch token and the class token
    else:  # encoders: the last quarter of the second half of the batch is padding; decoders: none
        padded = 2 * 8 if family in models.ENCODERS else 0
        assert kept.shape == (4 * 32 - padded, 128)


def test_a_size_sets_the_dimensions_and_the_default_shapes():
    args = models.parse_args(["--size", "8b"])
    assert (args.batch, args.seq, args.layers) == (1, 4096, 2)
    assert models.SIZES["8b"][0] == (4096, 32, 8, 14336)  # issue 34's 7-8B decoder layer
    args = models.parse_args(["--size", "8b", "--seq", "16384"])
    assert (args.batch, args.seq, args.layers) == (1, 16384, 2)
    args = models.parse_args(["--serving"])
    assert args.size == "serving" and (args.batch, args.seq) == (64, 128)
    assert models.parse_args([]).size == "base"
