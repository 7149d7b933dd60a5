"""Code generation shared by the fused templates: elementwise chains -> C++ (`chain`: at the
output element, for tiles and vectors; `indexed`: over coordinates, any layout op and value type)."""

from stof_cc.codegen.chain import Chain, NotFusable, NotItsPattern, Operand, rounded_to
from stof_cc.codegen.indexed import IndexedChain

__all__ = ["Chain", "IndexedChain", "NotFusable", "NotItsPattern", "Operand", "rounded_to"]
