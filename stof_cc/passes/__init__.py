"""Graph -> Graph passes, run in this order: canonicalize, merge_parallel_linears,
recognise_attention, describe_key_padding (`run_passes` does all four); then `partition`
groups the result."""

from stof_cc.ir.graph import Graph
from stof_cc.passes.attention import AttentionReport, recognise_attention
from stof_cc.passes.canonicalize import CanonicalizeReport, canonicalize
from stof_cc.passes.fusion import FusionPlan, partition
from stof_cc.passes.horizontal import HorizontalReport, merge_parallel_linears
from stof_cc.passes.key_padding import KeyPaddingReport, describe_key_padding


def run_passes(graph: Graph, canonical: CanonicalizeReport | None = None, attention: AttentionReport | None = None,
               padding: KeyPaddingReport | None = None, horizontal: HorizontalReport | None = None) -> Graph:
    """canonicalize, merge_parallel_linears, recognise_attention, describe_key_padding."""
    merged = merge_parallel_linears(canonicalize(graph, report=canonical), report=horizontal)
    return describe_key_padding(recognise_attention(merged, report=attention), report=padding)

__all__ = ["AttentionReport", "CanonicalizeReport", "FusionPlan", "HorizontalReport", "KeyPaddingReport",
           "canonicalize", "describe_key_padding", "merge_parallel_linears", "partition", "recognise_attention",
           "run_passes"]
