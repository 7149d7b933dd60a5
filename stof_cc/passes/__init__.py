"""Graph -> Graph passes: canonicalize (attention recognition and fusion are not built yet)."""

from stof_cc.passes.canonicalize import CanonicalizeReport, canonicalize

__all__ = ["CanonicalizeReport", "canonicalize"]
