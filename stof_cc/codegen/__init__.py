"""Code generation shared by the fused templates: elementwise chains -> C++ (`chain`)."""

from stof_cc.codegen.chain import Chain, NotFusable, NotItsPattern, Operand

__all__ = ["Chain", "NotFusable", "NotItsPattern", "Operand"]
