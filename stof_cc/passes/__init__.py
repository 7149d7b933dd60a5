"""Graph -> Graph passes, run in this order (`run_passes`): canonicalize, canonical_gemms,
recognise_norms, merge_parallel_linears, recognise_attention, describe_key_padding,
read_kv_heads_directly, recognise_rotary, recognise_overflow_clamp, simplify_gemm_layouts; then
`partition` groups the result. `lower` runs the whole road from a module (`lower.py`)."""

from stof_cc.passes.attention import AttentionReport, recognise_attention
from stof_cc.passes.canonicalize import CanonicalizeReport, canonicalize
from stof_cc.passes.fusion import FusionPlan, partition
from stof_cc.passes.gemm_forms import GemmFormsReport, canonical_gemms
from stof_cc.passes.gqa import GqaReport, read_kv_heads_directly
from stof_cc.passes.horizontal import HorizontalReport, merge_parallel_linears
from stof_cc.passes.key_padding import KeyPaddingReport, describe_key_padding
from stof_cc.passes.lower import PassReports, cast_floating, dump_to, lower, run_passes
from stof_cc.passes.norms import NormsReport, recognise_norms
from stof_cc.passes.rotary import RotaryReport, recognise_rotary

__all__ = ["AttentionReport", "CanonicalizeReport", "FusionPlan", "GemmFormsReport", "GqaReport", "HorizontalReport", "KeyPaddingReport",
           "PassReports", "NormsReport", "RotaryReport", "canonical_gemms", "canonicalize", "cast_floating", "describe_key_padding", "dump_to", "lower",
           "merge_parallel_linears", "partition", "read_kv_heads_directly", "recognise_attention", "recognise_norms", "recognise_rotary", "run_passes"]
