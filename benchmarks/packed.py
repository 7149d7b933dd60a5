"""Packed sequences with new boundaries every call (issue 35's bar): the whole call, mask included.

    python benchmarks/packed.py [--seq 32768] [--docs 8,16,64] [--heads 16] [--head-dim 128]
                                [--dtype bfloat16] [--calls 16] [--passes 5] [--json out.json] [--append]

Per document count N: B = 1, one row of ``--seq`` tokens cut into N documents at N - 1 random
points (a fixed seed; ``--calls`` such boundary sets), causal within each document, as a
padding-free LLM batch packs them. Each implementation runs every set once per pass, so each call
brings new boundaries, and a call's time is the pass's wall time (CUDA synchronised at its ends)
over ``--calls``, the median over ``--passes`` passes after a warm-up pass:

- ``stof_varlen``: `stof_cc.attention(q, k, v, masks.causal(), cu_seqlens=cu_seqlens)`, the
  boundaries as FlashAttention's cumulative lengths (int32, on the device, made before timing, as
  a collator hands them over): one plan for every call, the documents read by the kernels' row-window
  variant (the whole call: what the bar measures);
- ``stof_varlen_graph``: the same call captured once in a CUDA graph on one cu_seqlens buffer; each
  call copies its boundaries into the buffer and replays (the bar's "in a CUDA graph");
- ``stof``: `stof_cc.attention(q, k, v, masks.causal() & masks.document(lengths))`, the
  description made in the call, as a user makes it (its kernel choice is shared by masks of one
  kind, its block mask built per call on the host);
- ``stof_mask_mod``: `stof_cc.attention(q, k, v, masks.from_mask_mod(mask_mod))` with the mask_mod a
  FlexAttention user writes (the ``flex`` row's, over that call's document ids), made in the call: its
  code compiled once, its block mask assembled on the GPU per call (`BlockMask.from_grid`), its kernel
  choice shared by closures of one code (`MaskDescription.choice_group`);
- ``stof_prebuilt``: the same masks described and planned before timing: the attention alone,
  which the bar measures the whole call against (within 1.1x);
- ``fa4_varlen``: FlashAttention-4's `flash_attn_varlen_func` with ``cu_seqlens`` (int32, on the
  device, made before timing, as a collator hands them over) and ``causal=True``, on [S, H, D]
  tensors, where `flash_attn.cute` imports;
- ``flex`` and ``flex_flash``: `create_block_mask` of the user's mask_mod (document ids on the
  device, made before timing) in every call, then `torch.compile(flex_attention)`, the second on
  FA4's kernels (``kernel_options={"BACKEND": "FLASH"}``).

Every implementation is first checked on every boundary set against the fp32 reference on 256
sampled query rows (the largest relative error < 1e-2; this pass is also each one's first call
per set); a wrong or failing one is reported, not timed.
The bar: stof_varlen within 1.1x of stof_prebuilt, and >= 1.2x faster than FA4's varlen function and Flex
with a per-call block mask.
Needs an NVIDIA GPU, PyCUDA and nvcc.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mha import fa4_available  # noqa: E402
from work_log import append_to_work_log  # noqa: E402

from stof_cc import masks  # noqa: E402
from stof_cc.ir.reference import masked_attention, relative_error  # noqa: E402

TOLERANCE = 1e-2
SAMPLED_ROWS = 256
IMPLEMENTATIONS = ("stof_varlen", "stof_varlen_graph", "stof", "stof_mask_mod", "stof_prebuilt", "fa4_varlen", "flex", "flex_flash")


def boundary_sets(seq: int, docs: int, calls: int, seed: int = 0) -> list[list[int]]:
    """``calls`` lists of ``docs`` document lengths (each >= 1) summing to ``seq``: cuts at
    ``docs - 1`` distinct random points."""
    generator = torch.Generator().manual_seed(seed * 1000 + docs)
    sets = []
    for _ in range(calls):
        cuts = sorted((torch.randperm(seq - 1, generator=generator)[: docs - 1] + 1).tolist())
        sets.append([b - a for a, b in zip([0, *cuts], [*cuts, seq], strict=True)])
    return sets


def document_ids(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [S]: each position's document."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                   torch.tensor(lengths)).to(device)


def sampled_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                      rows: torch.Tensor) -> torch.Tensor:
    """The fp32 reference of causal-within-documents attention on query ``rows`` only:
    [B, H, len(rows), D]."""
    ids = document_ids(lengths, q.device)
    positions = torch.arange(q.shape[2], device=q.device)
    allowed = (ids[rows][:, None] == ids[None, :]) & (rows[:, None] >= positions[None, :])
    return masked_attention(q[:, :, rows], k, v, allowed)


def implementations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sets: list[list[int]]) \
        -> dict[str, Callable[[int], torch.Tensor]]:
    """Each implementation as ``run(i)`` on boundary set i, returning [B, H, S, D]; what each
    may prepare before timing is prepared here (the module docstring says what)."""
    from stof_cc.runtime.attention import attention

    causal = masks.causal()
    bounds = _cu_seqlens(sets, q.device)
    runs: dict[str, Callable[[int], torch.Tensor]] = {
        "stof_varlen": lambda i: attention(q, k, v, causal, cu_seqlens=bounds[i]),
        "stof": lambda i: attention(q, k, v, masks.causal() & masks.document(sets[i])),
    }
    ids = [document_ids(lengths, q.device) for lengths in sets]
    runs["stof_mask_mod"] = lambda i: attention(q, k, v, masks.from_mask_mod(_documents_mask_mod(ids[i])))
    runs["stof_varlen_graph"] = _captured(lambda cu_seqlens: attention(q, k, v, causal, cu_seqlens=cu_seqlens), bounds)
    prebuilt = [masks.causal() & masks.document(lengths) for lengths in sets]
    runs["stof_prebuilt"] = lambda i: attention(q, k, v, prebuilt[i])
    for i in range(len(sets)):  # described and planned (block mask, kernel, schedule) before timing
        attention(q, k, v, prebuilt[i])
    if fa4_available():
        runs["fa4_varlen"] = _fa4_varlen(q, k, v, sets)
    runs["flex"] = _flex(q, k, v, sets, None)
    runs["flex_flash"] = _flex(q, k, v, sets, {"BACKEND": "FLASH"})
    return runs


def _captured(call: Callable[[torch.Tensor], torch.Tensor], bounds: list[torch.Tensor]):
    """``run(i)``: ``call`` captured once in a CUDA graph on one cu_seqlens buffer, each call copying
    boundary set i into the buffer and replaying (every set has as many documents: one buffer size)."""
    buffer = bounds[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # plans and compiles outside the capture, as torch.cuda.graph asks
        call(buffer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(buffer)

    def run(i: int) -> torch.Tensor:
        buffer.copy_(bounds[i])
        graph.replay()
        return out
    return run


def _cu_seqlens(sets: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Each boundary set as FlashAttention's cumulative lengths, int32 on the device (as a collator
    hands them over)."""
    return [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
            for lengths in sets]


def _fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sets: list[list[int]]):
    from flash_attn.cute import flash_attn_varlen_func

    q_, k_, v_ = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [S, H, D], laid out once
    bounds = _cu_seqlens(sets, q.device)

    def run(i: int) -> torch.Tensor:
        longest = max(sets[i])
        out = flash_attn_varlen_func(q_, k_, v_, cu_seqlens_q=bounds[i], cu_seqlens_k=bounds[i],
                                     max_seqlen_q=longest, max_seqlen_k=longest, causal=True)
        return (out[0] if isinstance(out, tuple) else out).transpose(0, 1)[None]
    return run


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sets: list[list[int]], kernel_options):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.cache_size_limit = 1000
    compiled = torch.compile(flex_attention, dynamic=False)  # as mha.py's peer: FA4's kernels refuse SymInts
    ids = [document_ids(lengths, q.device) for lengths in sets]
    seq = q.shape[2]

    def run(i: int) -> torch.Tensor:
        doc = ids[i]
        block_mask = create_block_mask(_documents_mask_mod(doc), 1, None, seq, seq, device=q.device, _compile=True)
        return compiled(q, k, v, block_mask=block_mask, kernel_options=kernel_options)
    return run


def _documents_mask_mod(doc: torch.Tensor) -> Callable:
    """The mask_mod a FlexAttention user writes for packed causal documents (ids on the device)."""
    return lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki)


def per_call_ms(run: Callable[[int], torch.Tensor], calls: int, passes: int) -> float:
    """Median over passes of a pass's wall time over its calls (each call a new boundary set)."""
    for i in range(calls):  # warm-up: compiles, first plans
        run(i)
    times = []
    for _ in range(passes):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(calls):
            run(i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3 / calls)
    return statistics.median(times)


def run_point(seq: int, docs: int, args) -> dict:
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, args.heads, seq, args.head_dim, device="cuda", dtype=dtype) for _ in range(3))
    sets = boundary_sets(seq, docs, args.calls)
    rows = torch.randperm(seq, device="cuda")[:SAMPLED_ROWS].sort().values
    wants = [sampled_reference(q, k, v, lengths, rows) for lengths in sets]
    row: dict = {"seq": seq, "docs": docs, "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype}
    with torch.no_grad():
        try:
            runs = implementations(q, k, v, sets)
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            return row | {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        for name, run in runs.items():
            try:
                row[f"{name}_err"] = max(relative_error(run(i)[:, :, rows], want) for i, want in enumerate(wants))
                ok = row[f"{name}_err"] < TOLERANCE
                row[f"{name}_ms"] = per_call_ms(run, args.calls, args.passes) if ok else math.inf
            except Exception as exc:  # noqa: BLE001
                row[f"{name}_ms"], row[f"{name}_error"] = math.inf, f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def table(rows: list[dict], head: str) -> str:
    def cell(row: dict, name: str) -> str:
        if f"{name}_error" in row:
            return "error"
        ms = row.get(f"{name}_ms")
        return "-" if ms is None else f"{ms:.3f}" if math.isfinite(ms) else "wrong"

    lines = [head, "", "| S | documents | " + " | ".join(f"{n} ms" for n in IMPLEMENTATIONS)
             + " | stof_varlen / prebuilt | best peer / stof_varlen |",
             "|---|---|" + "---|" * (len(IMPLEMENTATIONS) + 2)]
    for row in rows:
        stof = row.get("stof_varlen_ms", math.inf)
        peers = [row.get(f"{n}_ms", math.inf) for n in ("fa4_varlen", "flex", "flex_flash")]
        overhead = stof / row.get("stof_prebuilt_ms", math.inf)
        speedup = min(peers) / stof
        lines.append(f"| {row['seq']} | {row['docs']} | " + " | ".join(cell(row, n) for n in IMPLEMENTATIONS)
                     + f" | {overhead:.2f}x | {speedup:.2f}x |" + (f" {row['error']}" if "error" in row else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--docs", default="8,16,64", help="document counts, comma separated")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    parser.add_argument("--calls", type=int, default=16, help="boundary sets (calls per pass)")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--append", action="store_true", help="append the table to the work log, benchmarks/history/")
    args = parser.parse_args()
    rows = []
    for docs in (int(d) for d in args.docs.split(",")):
        rows.append(run_point(args.seq, docs, args))
        print(rows[-1], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    head = (f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, {args.dtype}, H = {args.heads}, D = {args.head_dim}")
    text = table(rows, head)
    print(text)
    if args.append:
        append_to_work_log(f"\n## Packed sequences, new boundaries every call\n\n{text}\n")


if __name__ == "__main__":
    main()
