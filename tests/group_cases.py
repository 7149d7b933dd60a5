"""Fusion-group test cases shared by the CPU compile test and the GPU numerics test."""

from __future__ import annotations

import torch

from stof_cc.ir.frontend import trace
from stof_cc.passes import canonicalize, partition
from stof_cc.templates.elementwise import ELEMENTWISE
from stof_cc.templates.gemm_epilogue import GEMM_EPILOGUE
from stof_cc.templates.gemm_layernorm import GEMM_LAYERNORM
from stof_cc.templates.pricing import H100
from stof_cc.templates.row_reduce import ROW_REDUCE
from stof_cc.tune.scheme import choose_scheme

DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(8, 512, 768), (3, 7, 1000), (5, 100)]  # BERT-base rows; rows and counts no tile divides


class BiasGeluResidual(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x + self.bias) * 0.5 + r


class ResidualLayerNormSilu(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(width))
        self.norm = torch.nn.LayerNorm(width)
        torch.nn.init.normal_(self.norm.weight)
        torch.nn.init.normal_(self.norm.bias)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.norm(x + self.bias + r))


class ScaledSoftmax(torch.nn.Module):
    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 0.125 + r, dim=-1)


class RmsNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(width, eps=1e-6)
        torch.nn.init.normal_(self.norm.weight)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm(x - r)



class LinearGelu(torch.nn.Module):
    """The FFN's first GEMM: x W^T + b, then GELU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, 2 * width if width % 8 == 0 else 200)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


class LinearTanhGelu(torch.nn.Module):
    """GPT-2's FFN GEMM: tanh-GELU written out, reading the GEMM's value three times (and
    cubing negative values, which fast-math powf turned into NaN)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, 2 * width if width % 8 == 0 else 200)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))


class LinearResidual(torch.nn.Module):
    """The attention output projection: x W^T + b + residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + r


class LinearResidualLayerNorm(torch.nn.Module):
    """BERT's output block, then an activation: LayerNorm(x W^T + b + residual) -> SiLU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        torch.nn.init.normal_(self.norm.weight)
        torch.nn.init.normal_(self.norm.bias)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.norm(self.proj(x) + r))


class LinearRmsNorm(torch.nn.Module):
    """RMSNorm(x W^T - residual), no bias: the other norm gemm_layernorm serves."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.norm = torch.nn.RMSNorm(width, eps=1e-6)
        torch.nn.init.normal_(self.norm.weight)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x) - r)


class HeadSplit(torch.nn.Module):
    """A Q projection whose store writes the (batch, head, seq, head_dim) layout directly."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q = torch.nn.Linear(width, width)
        self.heads = width // 64 if width % 64 == 0 else 1

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        *lead, width = x.shape
        return self.q(x).view(*lead, self.heads, width // self.heads).transpose(-3, -2)


class RowMean(torch.nn.Module):
    """One value per row with a prologue: Cohere writes its LayerNorm's mean so."""

    def __init__(self, width: int) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (x * 0.5 + r).mean(-1, keepdim=True)


class RowVar(RowMean):
    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.var(x + r, dim=-1, keepdim=True, correction=0)


class RowAmax(RowMean):
    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (x - r).amax(-1)


class Fp32WeightNorm(torch.nn.Module):
    """Cohere's LayerNorm: computed in fp32 with an fp32 weight, stored in the model's dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.layer_norm((x + r).float(), (x.shape[-1],))
        return (self.weight.float() * y).to(x.dtype)


class GatedPieces(torch.nn.Module):
    """A mixture of experts' gate and up projection, one tensor split in two along its last dimension
    (the elementwise template reads each half as columns of it), then a slice of the other input."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up + r[..., x.shape[-1] // 2:]


class RegroupedResidual(torch.nn.Module):
    """A residual added over a view that regroups the leading dimensions ([T, H] back to [B, S, H]), into
    an fp32 output: flat views cost nothing, and 16-bit inputs are read in vectors beside fp32 stores."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) * 2.0
        return (rows.view(x.shape) + r).float()


# (module type, template, group kind)
CASES = [(BiasGeluResidual, ELEMENTWISE, "elementwise"), (GatedPieces, ELEMENTWISE, "elementwise"),
         (RegroupedResidual, ELEMENTWISE, "elementwise"), (ResidualLayerNormSilu, ROW_REDUCE, "reduction"),
         (ScaledSoftmax, ROW_REDUCE, "reduction"), (RmsNorm, ROW_REDUCE, "reduction"),
         (RowMean, ROW_REDUCE, "reduction"), (RowVar, ROW_REDUCE, "reduction"), (RowAmax, ROW_REDUCE, "reduction"),
         (Fp32WeightNorm, ROW_REDUCE, "reduction")]
# a split whose pieces start on a vector at rows no tile divides (every point runs there, the vectorised ones too)
ALIGNED_PIECES = [(GatedPieces, ELEMENTWISE, "elementwise", (3, 7, 1040))]
GEMM_CASES = [(LinearGelu, GEMM_EPILOGUE, "gemm"), (LinearTanhGelu, GEMM_EPILOGUE, "gemm"),
              (LinearResidual, GEMM_EPILOGUE, "gemm"),
              (HeadSplit, GEMM_EPILOGUE, "gemm"), (LinearResidualLayerNorm, GEMM_LAYERNORM, "gemm"),
              (LinearRmsNorm, GEMM_LAYERNORM, "gemm")]
GEMM_SHAPES = [(8, 512, 768), (3, 333, 264)]  # BERT-base (M = 4096); M, N, K no tile divides (K % 8 == 0)


def build(module_type, kind: str, shape: tuple[int, ...], dtype: torch.dtype):
    """(module, inputs, graph, the one group of ``kind`` in the scheme stage 1 chooses) on fresh
    random inputs. The GEMM + norm modules take their one alternative scheme (the norm merged
    into the GEMM group) whatever stage 1 chooses: they are gemm_layernorm's cases."""
    takes_width = module_type not in (ScaledSoftmax, GatedPieces, RegroupedResidual)
    module = (module_type(shape[-1]) if takes_width else module_type()).to(dtype)
    inputs = (torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
    graph = canonicalize(trace(module, inputs, {}))
    plan = partition(graph)
    if module_type in (LinearResidualLayerNorm, LinearRmsNorm):
        ((_, scheme),) = plan.alternatives
    else:
        scheme = choose_scheme(graph, plan, H100).scheme
    (group,) = [g for g in scheme.groups if g.kind == kind]
    return module, inputs, graph, group
