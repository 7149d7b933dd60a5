"""Graph -> Graph passes, run in this order: canonicalize, recognise_attention,
describe_key_padding (`run_passes` does all three); then `partition` groups the result."""

from stof_cc.ir.graph import Graph
from stof_cc.passes.attention import AttentionReport, recognise_attention
from stof_cc.passes.canonicalize import CanonicalizeReport, canonicalize
from stof_cc.passes.fusion import FusionPlan, partition
from stof_cc.passes.key_padding import KeyPaddingReport, describe_key_padding


def run_passes(graph: Graph, canonical: CanonicalizeReport | None = None, attention: AttentionReport | None = None,
               padding: KeyPaddingReport | None = None) -> Graph:
    """canonicalize, then recognise_attention, then describe_key_padding."""
    return describe_key_padding(recognise_attention(canonicalize(graph, report=canonical), report=attention),
                                report=padding)

__all__ = ["AttentionReport", "CanonicalizeReport", "FusionPlan", "KeyPaddingReport", "canonicalize",
           "describe_key_padding", "partition", "recognise_attention", "run_passes"]
