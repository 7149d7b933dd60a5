"""Graph -> Graph passes, run in the order of `lower.PIPELINE` (`run_passes`); then `partition`
groups the result. `lower` runs the whole road from a module (`lower.py`)."""

from stof_cc.passes.attention import AttentionReport, recognise_attention
from stof_cc.passes.canonicalize import CanonicalizeReport, canonicalize
from stof_cc.passes.fusion import FusionPlan, partition
from stof_cc.passes.gemm_forms import GemmFormsReport, canonical_gemms
from stof_cc.passes.gqa import GqaReport, read_kv_heads_directly
from stof_cc.passes.horizontal import HorizontalReport, merge_parallel_linears
from stof_cc.passes.key_padding import KeyPaddingReport, describe_key_padding
from stof_cc.passes.lower import PIPELINE, PassReports, cast_floating, dump_to, lower, run_passes
from stof_cc.passes.patterns import RULES, recognise_patterns
from stof_cc.passes.rules import Rule, RulesReport

__all__ = ["PIPELINE", "RULES", "AttentionReport", "CanonicalizeReport", "FusionPlan", "GemmFormsReport", "GqaReport",
           "HorizontalReport", "KeyPaddingReport", "PassReports", "Rule", "RulesReport", "canonical_gemms",
           "canonicalize", "cast_floating", "describe_key_padding", "dump_to", "lower", "merge_parallel_linears",
           "partition", "read_kv_heads_directly", "recognise_attention", "recognise_patterns", "run_passes"]
