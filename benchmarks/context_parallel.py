"""Context-parallel masked attention (issue 37's bar) under torchrun: stof-cc's
`context_parallel_attention` on every rank beside one GPU's `stof_cc.attention` and, for the
causal mask, PyTorch's `context_parallel` (ring attention over SDPA).

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py [--seq 131072] [--heads 16] [--head-dim 128]
                                                              [--masks causal,sliding,document,bigbird]
                                                              [--dtype bfloat16] [--repeats 10] [--no-peer]

Every rank makes the same full random q, k, v (B = 1); rank 0 runs the whole problem alone on its
GPU (the one-GPU time and the reference output); then every rank takes its load-balanced shard
(`shard_sequence`) and the context-parallel call is timed (a barrier before each call, medians).
The error is the gathered output's distance from the one-GPU output; "sent" is what each rank sends
per call against a ring's (every rank's K/V to every other rank). Masks: causal, sliding window
(w = 4096), 16 documents of equal length, BigBird (block 64, 1 global block, 3 window blocks,
2 random blocks). Needs NVIDIA GPUs, PyCUDA and nvcc.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stof_cc import masks  # noqa: E402
from stof_cc.distributed import (  # noqa: E402
    context_parallel_attention,
    context_parallel_plan,
    gather_sequence,
    shard_sequence,
)
from stof_cc.runtime.attention import attention  # noqa: E402

MASKS = {
    "causal": lambda seq: masks.causal(),
    "sliding": lambda seq: masks.sliding_window(4096),
    "document": lambda seq: masks.document([seq // 16] * 16),
    "bigbird": lambda seq: masks.bigbird(64, 1, 3, 2),
}


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn`` after two warm-ups, every rank in step."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def ring_sdpa_ms(q, k, v, repeats: int) -> float:
    """PyTorch's context_parallel (ring attention over SDPA, causal, its own load balancing)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    q, k, v = (t.clone() for t in (q, k, v))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        return median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("context_parallel.py needs NVIDIA GPUs (run it under torchrun)", file=sys.stderr)
        return 2
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    rows = []
    with torch.no_grad():
        for name in args.masks.split(","):
            mask = MASKS[name](args.seq)
            alone = want = None
            if rank == 0:
                want = attention(q, k, v, mask)
                alone = _time_alone(q, k, v, mask, args.repeats)
            shards = [shard_sequence(t, rank, world) for t in (q, k, v)]
            split = median_ms(lambda mask=mask, shards=shards: context_parallel_attention(*shards, mask),
                              args.repeats)
            got = gather_sequence(context_parallel_attention(*shards, mask))
            plan = context_parallel_plan(mask, args.seq, world, batch=1, heads=args.heads)
            chunk_bytes = 2 * (shards[1].numel() // 2) * shards[1].element_size()  # K and V of one of its 2 chunks
            peer = None
            if name == "causal" and not args.no_peer:
                try:
                    peer = ring_sdpa_ms(q, k, v, args.repeats)
                except Exception as exc:  # a peer that fails is reported, not fatal
                    print(f"rank {rank}: context_parallel with SDPA failed: {type(exc).__name__}: {exc}",
                          file=sys.stderr)
            if rank == 0:
                error = float((got.float() - want.float()).norm() / want.float().norm())
                sent = max(plan.bytes_sent(r, chunk_bytes) for r in range(world))
                rows.append((name, alone, split, peer, error, sent, plan.ring_bytes_sent(chunk_bytes)))
    if rank == 0:
        print(f"context parallel, {world} GPUs ({torch.cuda.get_device_name()}), B = 1, S = {args.seq}, "
              f"H = {args.heads}, D = {args.head_dim}, {dtype}")
        print("| mask | one GPU ms | CP ms | speedup over one GPU | ring SDPA ms | vs ring | error | "
              "sent per rank MB (most) | ring MB |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, alone, split, peer, error, sent, ring in rows:
            ring_cell = f"{peer:.2f} | {peer / split:.2f}x" if peer else "- | -"
            print(f"| {name} | {alone:.2f} | {split:.2f} | {alone / split:.2f}x | {ring_cell} | {error:.1e} | "
                  f"{sent / 1e6:.0f} | {ring / 1e6:.0f} |")
    dist.destroy_process_group()
    return 0


def _time_alone(q, k, v, mask, repeats: int) -> float:
    """Rank 0's one-GPU time, after one warm-up, while the other ranks wait at the next barrier."""
    attention(q, k, v, mask)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        attention(q, k, v, mask)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
