"""The vendor GEMM as a measured choice (issue 34): cuBLAS, called as users call it (torch's
`F.linear`), is timed beside the generated GEMM, as Inductor keeps its ATen choice beside its
templates.

Two decisions use it, both by measurement only (no estimate of cuBLAS exists, so an untuned
model keeps the generated kernels):

* a GEMM group that is one `linear` runs in the library where its library record is faster than
  its generated one (`library_wins`; the runtime makes it a "library" step);
* a GEMM group with an epilogue is split into its `linear` and the epilogue as a generated
  elementwise group where the two measured apart beat the fused kernel (`library_split`, used by
  `choose_scheme`): no GEMM group is then slower than cuBLAS plus its epilogue.

The tuning database keeps the library's time as a record of `LIBRARY_GEMM` (no parameters), keyed
like a template's by a digest of torch's and CUDA's versions (cuBLAS comes with them).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

from stof_cc.ir.graph import Graph
from stof_cc.passes.fusion import FusionGroup, sub_group


class LibraryGemm:
    """cuBLAS through `torch.nn.functional.linear`, as a tuning-database "template"."""

    name = "library_gemm"

    # how stage 2 times it, part of the record's key: records timed on operands left in L2 (four input
    # sets) must not stand beside generated kernels timed on operands from DRAM (docs/decisions.md#deep-rings)
    TIMING = "input sets holding twice the L2, rotated across launches"

    def digest(self) -> str:
        """What decides cuBLAS's recorded speed, as far as torch tells: its own and CUDA's versions,
        and how stage 2 timed it (`TIMING`)."""
        return hashlib.sha256(f"torch {torch.__version__} cuda {torch.version.cuda} timing {self.TIMING}"
                              .encode()).hexdigest()


LIBRARY_GEMM = LibraryGemm()


def is_lone_linear(graph: Graph, group: FusionGroup) -> bool:
    """``group`` is one `linear` node: what the library can run alone."""
    return group.kind == "gemm" and len(group.nodes) == 1 and graph.node(group.nodes[0]).op == "linear"


def linear_and_epilogue(graph: Graph, group: FusionGroup) -> tuple[FusionGroup, FusionGroup] | None:
    """``group`` as its `linear` alone and the rest (an elementwise group, or a reduction group
    where a norm was merged in), when it is a GEMM group that starts at its `linear` and has an
    epilogue; else None."""
    if group.kind != "gemm" or len(group.nodes) < 2 or group.nodes[0] != group.anchor \
            or graph.node(group.anchor).op != "linear":
        return None
    return sub_group(graph, group, group.nodes[:1], "l"), sub_group(graph, group, group.nodes[1:], "e")


def library_split(graph: Graph, groups: list[FusionGroup],
                  measured: Callable[[FusionGroup], float | None]) -> tuple[list[FusionGroup], list[str]]:
    """``groups`` with every GEMM group whose `linear` and epilogue, measured apart (the linear at
    its best: library or generated), beat its fused kernel split in two; a line per decision
    that was measured."""
    out, notes = [], []
    for group in groups:
        parts = linear_and_epilogue(graph, group)
        times = [measured(g) for g in (group, *parts)] if parts is not None else [None]
        if None in times:
            out.append(group)
            continue
        fused, apart = times[0], times[1] + times[2]
        if apart < fused:
            out += parts
            notes.append(f"{group.name}: linear and epilogue apart ({times[1]:.1f} + {times[2]:.1f} us measured "
                         f"against {fused:.1f} us fused)")
        else:
            out.append(group)
            notes.append(f"{group.name}: fused ({fused:.1f} us measured against {apart:.1f} us apart)")
    return out, notes


def library_wins(library_us: float | None, generated_us: float | None) -> bool:
    """The library runs a lone linear when it was measured faster than the generated GEMM (or
    the generated one has no record: it failed or was never measured)."""
    return library_us is not None and library_us < (math.inf if generated_us is None else generated_us)
