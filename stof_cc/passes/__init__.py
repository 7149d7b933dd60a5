"""Graph -> Graph passes, run in this order: canonicalize, recognise_attention; then
`partition` groups the result for code generation (which is not built yet)."""

from stof_cc.passes.attention import AttentionReport, recognise_attention
from stof_cc.passes.canonicalize import CanonicalizeReport, canonicalize
from stof_cc.passes.fusion import FusionPlan, partition

__all__ = ["AttentionReport", "CanonicalizeReport", "FusionPlan", "canonicalize", "partition", "recognise_attention"]
