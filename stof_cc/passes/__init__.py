"""Graph -> Graph passes, run in this order: canonicalize, recognise_attention (fusion is not built yet)."""

from stof_cc.passes.attention import AttentionReport, recognise_attention
from stof_cc.passes.canonicalize import CanonicalizeReport, canonicalize

__all__ = ["AttentionReport", "CanonicalizeReport", "canonicalize", "recognise_attention"]
