"""Memory-bound groups against the HBM limit and against Inductor (issue 34): bytes moved per
second by each group template's kernel.

    python benchmarks/memory_bound.py [--cases rms_norm,layer_norm,...] [--sizes 16384x4096,...]
                                      [--dtype float16] [--no-compile] [--json out.json] [--append]

Per case and size ([rows, width] of every activation): the group stof-cc's fusion forms,
searched as `stof-cc tune` searches it and its winner timed (the rotary case: the rotary
kernel, which has no parameters); Inductor's kernel for the same module (`torch.compile`,
default mode); eager. Bytes moved = every tensor the kernel reads (activations and weights)
plus what it writes, each once; TB/s = bytes / median time. Each is timed in a stream of
launches over input sets that hold twice the L2, each launch writing a new output, in one CUDA
graph (`kernel_timing.stream_ms`: each launch pays for the write-back its predecessor left, as in
a model; the table's rates), and after do_bench's L2 flush, which leaves 50 MB of dirty lines
whose write-backs the kernel also pays (stof-cc's and the copy's rates in a column of their own). Cases: ``rms_norm`` (Llama's, fp32
inside, weight after), ``layer_norm`` (residual add + LayerNorm, BERT's), ``softmax`` (scaled, over
the last dim), ``bias_gelu_residual`` and ``silu_mul`` (elementwise chains), ``rotary`` ([B, H, S, D]
with D = 128, rows = B H S). Every implementation is checked against the fp32 result first
(relative error < 1e-2). ``copy``: torch's copy of the same bytes (half read, half written), the
practical roof at that size. Issue 34's bar: every template >= 2.4 TB/s at >= 32 MB per activation,
and within 1.2x of Inductor at the small sizes. Needs an NVIDIA GPU, PyCUDA and nvcc.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor import group_bytes  # noqa: E402
from fusion import bench  # noqa: E402
from kernel_timing import check_and_time, parse_pairs, run_points, searched_kernel, stream_ms  # noqa: E402

from stof_cc.backends.rotary_launch import rotary  # noqa: E402
from stof_cc.passes import lower  # noqa: E402
from stof_cc.passes.fusion import is_views  # noqa: E402
from stof_cc.tune.model import input_set_count  # noqa: E402

SIZES = ((16384, 4096), (4096, 4096), (4096, 768), (1024, 768))  # 128 and 32 MB fp16, then small
HEAD_DIM = 128  # the rotary case's


class RmsNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class ResidualLayerNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm(x + r)


class ScaledSoftmax(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 0.125, dim=-1)


class BiasGeluResidual(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x + self.bias) + r


class SiluMul(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(a) * b


class Rotary(torch.nn.Module):
    """``x * cos + rotate_half(x) * sin`` as HF writes it, x [B, H, S, D]."""

    def __init__(self, width: int) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


# case -> (module type, number of [rows, width] activation inputs)
CASES = {"rms_norm": (RmsNorm, 1), "layer_norm": (ResidualLayerNorm, 2), "softmax": (ScaledSoftmax, 1),
         "bias_gelu_residual": (BiasGeluResidual, 2), "silu_mul": (SiluMul, 2), "rotary": (Rotary, 1)}


def case_inputs(case: str, rows: int, width: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """The case's inputs: ``rows`` x ``width`` activations (rotary: x [1, H, rows, 128] with H =
    width / 128 and its [1, 1, rows, 128] cos and sin)."""
    if case == "rotary":
        heads = width // HEAD_DIM
        x = torch.randn(1, heads, rows, HEAD_DIM, device=device, dtype=dtype)
        angles = torch.rand(1, 1, rows, HEAD_DIM, device=device) * 6.3
        return x, angles.cos().to(dtype), angles.sin().to(dtype)
    return tuple(torch.randn(rows, width, device=device, dtype=dtype) for _ in range(CASES[case][1]))


def kernel_group(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]):
    """(graph, the one group of the default scheme that is not views only), through every pass."""
    graph, plan = lower(module, inputs)
    (group,) = [g for g in plan.default.groups if not is_views(graph, g)]
    return graph, group


def generated(case: str, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]):
    """(stof-cc's kernel as a function of the case's inputs, its label, bytes moved)."""
    if case == "rotary":  # the rotary kernel a compiled model's rotary nodes run (no parameters)
        x = inputs[0]
        return rotary, "rotary", sum(t.numel() * t.element_size() for t in inputs) + x.numel() * x.element_size()
    graph, group = kernel_group(module, inputs)
    launch, label, values = searched_kernel(graph, group, inputs)
    names = [node.name for node in graph.inputs]
    return (lambda *xs: launch(values | dict(zip(names, xs, strict=True)))), label, group_bytes(graph, group)


def run_point(case: str, rows: int, width: int, dtype: torch.dtype, compile_peer: bool) -> dict:
    """Each implementation checked, then timed twice: after do_bench's L2 flush (``NAME_ms``) and in
    a stream over input sets that hold twice the L2 (``NAME_stream_ms``: kernel_timing.stream_ms)."""
    torch.manual_seed(0)
    module = CASES[case][0](width).to("cuda").eval()
    inputs = case_inputs(case, rows, width, dtype, "cuda")
    row = {"case": case, "rows": rows, "width": width}
    with torch.no_grad():
        want = module(*(t.float() for t in inputs))
        module.to(dtype)
        implementations = {"eager": module}  # each a function of the case's inputs
        try:
            implementations["stof"], row["stof_kernel"], row["bytes"] = generated(case, module, inputs)
        except Exception as exc:  # reported, not hidden
            row["stof_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if compile_peer:
            torch._dynamo.reset()  # each size compiled for its own shape: a second module of the same class
            implementations["inductor"] = torch.compile(module, dynamic=False)  # was compiled dynamic (review)
        check_and_time({name: functools.partial(f, *inputs) for name, f in implementations.items()}, want, row)
        if "bytes" not in row:
            return row
        sets = [inputs] + [case_inputs(case, rows, width, dtype, "cuda") for _ in range(input_set_count(row["bytes"]) - 1)]
        for name, f in implementations.items():
            if math.isfinite(row[f"{name}_ms"]):
                row[f"{name}_stream_ms"] = stream_ms([functools.partial(f, *one) for one in sets])
        # the roof at this size: a plain copy moving the same bytes (half read, half written)
        sources = [torch.randn(row["bytes"] // 4, device="cuda", dtype=torch.float16) for _ in sets]
        row["copy_ms"] = bench(sources[0].clone)
        row["copy_stream_ms"] = stream_ms([source.clone for source in sources])
    return row


def table(rows: list[dict], head: str) -> str:
    """Rates in the stream (the steady state of a model's kernels), then stof-cc's and the copy's after
    do_bench's flush, and Inductor's time over stof-cc's in the stream."""
    def rate(row: dict, key: str) -> str:
        ms = row.get(key, math.inf)
        return f"{row['bytes'] / ms / 1e9:.2f}" if "bytes" in row and math.isfinite(ms) else "-"

    lines = [head, "", "| case | rows x width | MB moved | stof kernel | stof TB/s | Inductor TB/s | eager TB/s | "
             "copy TB/s | stof / copy TB/s, L2 flushed | Inductor / stof time |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = row.get("inductor_stream_ms", math.inf) / row.get("stof_stream_ms", math.inf)
        megabytes = f"{row['bytes'] / 1e6:.0f}" if "bytes" in row else "-"
        lines.append(f"| {row['case']} | {row['rows']} x {row['width']} | {megabytes} | {row.get('stof_kernel', '-')} | "
                     + " | ".join(rate(row, f"{name}_stream_ms") for name in ("stof", "inductor", "eager", "copy"))
                     + f" | {rate(row, 'stof_ms')} / {rate(row, 'copy_ms')} | "
                     + (f"{ratio:.2f}x |" if math.isfinite(ratio) else "- |")
                     + "".join(f" {row[k]}" for k in row if k.endswith("_error")))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"some of {', '.join(CASES)}")
    parser.add_argument("--sizes", default=",".join(f"{r}x{w}" for r, w in SIZES), help="ROWSxWIDTH,...")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--no-compile", action="store_true", help="skip Inductor (torch.compile)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--append", action="store_true", help="append the table to the work log, benchmarks/history/")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    points = [functools.partial(run_point, case, rows, width, dtype, not args.no_compile)
              for case in args.cases.split(",") for rows, width in parse_pairs(args.sizes)]
    run_points(points, table, args.dtype, args.json, args.append, "Memory-bound groups (benchmarks/memory_bound.py)")

if __name__ == "__main__":
    main()
