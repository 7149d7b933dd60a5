"""benchmarks/hf_generate.py end to end on the CPU at a tiny size (stof_cc's attention runs in
SDPA there, said once): every family builds, both implementations share weights and give the
same greedy tokens, and the table reads them (the GPU run needs CUDA, PyCUDA and nvcc)."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from types import SimpleNamespace

import pytest
from conftest import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("benchmark_hf_generate", ROOT / "benchmarks" / "hf_generate.py")
hf_generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hf_generate)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3", "gpt_oss"])
def test_a_tiny_run_gives_the_baselines_tokens_and_a_table(family):
    """Each family beside its baseline: sdpa, or eager for GPT-OSS (transformers has no SDPA path for its sinks)."""
    hf_generate.stof_cc.hf.register()
    args = SimpleNamespace(hidden=256, layers=2, prompt=24, new=3, dtype="float32", rounds=2)
    baseline = "eager" if family == "gpt_oss" else "sdpa"
    assert hf_generate.implementations_of(family) == ("stof_cc", baseline, "flex_attention")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stof_cc's attention says once that it runs in SDPA on the CPU
        row = hf_generate.run(family, 2, args, implementations=("stof_cc", baseline), device="cpu")
    assert "errors" not in row, row.get("errors")
    assert row["baseline"] == baseline and row["first_difference"] == {"stof_cc": None, baseline: None}
    assert set(row["prefill_ms"]) == set(row["generate_s"]) == set(row["logits_error"]) == {"stof_cc", baseline}
    assert all(0 <= error < 1e-4 for error in row["logits_error"].values()), row["logits_error"]  # fp32 on the CPU
    name = family if baseline == "sdpa" else f"{family} (vs eager: no sdpa)"
    assert f"| {name} | 2 |" in hf_generate.table([row]) and "| identical |" in hf_generate.table([row])


def test_the_prompt_left_pads_half_the_batch():
    ids, mask = hf_generate.prompt_of(4, 16, "cpu")
    assert mask[:2].all() and not mask[2:, :4].any() and mask[2:, 4:].all() and (ids[mask == 0] == 0).all()
    assert hf_generate.prompt_of(1, 16, "cpu")[1].all()

