"""Code generation shared by the fused templates: elementwise chains -> C++ (`chain`)."""

from stof_cc.codegen.chain import Chain, NotFusable, Operand

__all__ = ["Chain", "NotFusable", "Operand"]
