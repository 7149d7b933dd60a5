"""Context-parallel masked attention (issue 37's bar) under torchrun: stof-cc's
`context_parallel_attention` on every rank beside one GPU's `stof_cc.attention`, FlexAttention under
PyTorch's context parallelism (every mask) and, for the causal mask, PyTorch's `context_parallel`
(ring attention over SDPA).

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py [--seq 131072] [--heads 16] [--head-dim 128]
                                                              [--masks causal,sliding,document,bigbird]
                                                              [--dtype bfloat16] [--repeats 10] [--no-peer]
    python benchmarks/context_parallel.py --compile-only 2,4      # no GPU: fill the kernel cache first

Every rank makes the same full random q, k, v (B = 1); rank 0 runs the whole problem alone on its
GPU (the one-GPU time and the reference output); then every rank takes its load-balanced shard
(`shard_sequence`) and the context-parallel call is timed (a barrier before each call, medians), with
the transfers overlapping the compute (the default) and without.
The error is the gathered output's distance from the one-GPU output; "sent" is what each rank sends
per call against a ring's (every rank's K/V to every other rank). A peer counts only within 1e-2 of
the one-GPU output. Masks: causal, sliding window (|q - k| <= 4096), 16 documents of equal length,
BigBird (that window, 32 global tokens, and the grid's random 64 x 64 blocks, 3 per block row on
average). Needs NVIDIA GPUs, PyCUDA and nvcc.
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
from stof_cc.backends.nvcc import compile_many  # noqa: E402
from stof_cc.distributed import (  # noqa: E402
    context_parallel_attention,
    context_parallel_plan,
    gather_sequence,
    precompile,
    shard_sequence,
)
from stof_cc.masks.workloads import GRID_RANDOM_BLOCK, GRID_RANDOM_BLOCKS, GRID_SEED  # noqa: E402
from stof_cc.masks.zoo import random_blocks  # noqa: E402
from stof_cc.runtime.attention import attention  # noqa: E402
from stof_cc.templates.attention import AttentionProblem, validated_problem  # noqa: E402
from stof_cc.templates.pricing import target_capability  # noqa: E402
from stof_cc.tune.attention import choose  # noqa: E402

SLIDING = 4096  # the window of the sliding and BigBird masks
GLOBAL_TOKENS = 32
MASKS = {
    "causal": lambda seq: masks.causal(),
    "sliding": lambda seq: masks.sliding_window(SLIDING),
    "document": lambda seq: masks.document([seq // 16] * 16),
    "bigbird": lambda seq: masks.bigbird(SLIDING, GLOBAL_TOKENS, GRID_RANDOM_BLOCKS, GRID_RANDOM_BLOCK, GRID_SEED),
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


def flex_cp_ms(q, k, v, name: str, seq: int, repeats: int):
    """FlexAttention under PyTorch's context parallelism, as torchtitan and PyTorch's own tests run it:
    `_ContextParallel(FLEX)` on a module calling `torch.compile(flex_attention)` (K/V all-gathered),
    the global BlockMask and q, k, v sharded by `_context_parallel_shard` with the head-tail load
    balancer (the same chunks per rank as stof-cc's), the user's mask_mod (`_flex_mask_mod`).
    Returns (median ms, this rank's output in the shard's layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard,
        _ContextParallel,
        _HeadTailLoadBalancer,
    )
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.flex = torch.compile(flex_attention, dynamic=False)

        def forward(self, q, k, v, block_mask):
            return self.flex(q, k, v, block_mask=block_mask)

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    mask_mod = _flex_mask_mod(name, seq)
    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cuda", _compile=True)
    balancer = _HeadTailLoadBalancer(seq, dist.get_world_size(), torch.device("cuda"))
    module = parallelize_module(Attention(), mesh,
                                _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    cq, ck, cv, cmask = _context_parallel_shard(mesh, [q, k, v, block_mask], [2] * 4, load_balancer=balancer)
    return median_ms(lambda: module(cq, ck, cv, block_mask=cmask), repeats), module(cq, ck, cv, block_mask=cmask)


def _flex_mask_mod(name: str, seq: int):
    """The mask_mod a FlexAttention user writes for the benchmark's masks (index arithmetic; BigBird's
    random blocks as a table, as in `stof_cc.masks.workloads.user_mask_mod`)."""
    if name == "causal":
        return lambda b, h, q, k: q >= k
    if name == "sliding":
        return lambda b, h, q, k: (q - k).abs() <= SLIDING
    if name == "document":
        length = seq // 16
        return lambda b, h, q, k: q // length == k // length
    rnd = random_blocks(GRID_RANDOM_BLOCKS, GRID_RANDOM_BLOCK, GRID_SEED).cells(seq, seq).cuda()
    size = GRID_RANDOM_BLOCK
    return lambda b, h, q, k: ((q - k).abs() <= SLIDING) | (q < GLOBAL_TOKENS) | (k < GLOBAL_TOKENS) \
        | rnd[q // size, k // size]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--compile-only", metavar="WORLDS",
                        help="no GPU needed: compile (nvcc, into the kernel cache) the kernels of the one-GPU run "
                             "and of context parallelism over each comma-separated world size, then exit")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only(args)
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
    if rank == 0:  # the table's rows follow as each mask is measured
        print(f"context parallel, {world} GPUs ({torch.cuda.get_device_name()}), B = 1, S = {args.seq}, "
              f"H = {args.heads}, D = {args.head_dim}, {dtype}")
        print("| mask | one GPU ms | CP ms | without overlap ms | speedup over one GPU | ring SDPA ms | vs ring "
              "| Flex CP ms | vs Flex CP | error | sent per rank MB (most) | ring MB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
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
            serial = median_ms(lambda mask=mask, shards=shards: context_parallel_attention(*shards, mask, overlap=False),
                               args.repeats)
            got = gather_sequence(context_parallel_attention(*shards, mask))
            got_serial = gather_sequence(context_parallel_attention(*shards, mask, overlap=False))
            plan = context_parallel_plan(mask, args.seq, world, batch=1, heads=args.heads)
            row_bytes = 2 * shards[1][..., :1, :].numel() * shards[1].element_size()  # K and V of one key row
            peer = None
            if name == "causal" and not args.no_peer:
                try:
                    peer = ring_sdpa_ms(q, k, v, args.repeats)
                except Exception as exc:  # a peer that fails is reported, not fatal
                    print(f"rank {rank}: context_parallel with SDPA failed: {type(exc).__name__}: {exc}",
                          file=sys.stderr)
            flex = flex_out = None
            if not args.no_peer:
                try:
                    flex, flex_out = flex_cp_ms(q, k, v, name, args.seq, args.repeats)
                except Exception as exc:
                    print(f"rank {rank}: FlexAttention under context parallelism failed: {type(exc).__name__}: "
                          f"{exc}", file=sys.stderr)
                ran = torch.tensor([flex_out is not None], device="cuda", dtype=torch.int32)
                dist.all_reduce(ran, op=dist.ReduceOp.MIN)  # a peer that failed on one rank counts on none
                flex, flex_out = (flex, gather_sequence(flex_out)) if ran.item() else (None, None)
            if rank == 0:
                error = max(_distance(got, want), _distance(got_serial, want))
                flex_error = None if flex_out is None else _distance(flex_out, want)
                if flex_error is not None and flex_error > 1e-2:  # only correct peers count
                    print(f"FlexAttention CP on {name}: error {flex_error:.1e}, not counted", file=sys.stderr)
                    flex = None
                sent = max(plan.bytes_sent(r, row_bytes) for r in range(world))
                ring_cell = f"{peer:.2f} | {peer / split:.2f}x" if peer else "- | -"
                flex_cell = f"{flex:.2f} | {flex / split:.2f}x" if flex else "- | -"
                print(f"| {name} | {alone:.2f} | {split:.2f} | {serial:.2f} | {alone / split:.2f}x | {ring_cell} | "
                      f"{flex_cell} | {error:.1e} | {sent / 1e6:.0f} | {plan.ring_bytes_sent(row_bytes) / 1e6:.0f} |",
                      flush=True)
    dist.destroy_process_group()
    return 0


def compile_only(args) -> int:
    """Every kernel a run of these arguments launches, compiled ahead (a machine without a GPU
    fills the cache that the GPU run then reads)."""
    dtype = getattr(torch, args.dtype)
    problem = validated_problem(AttentionProblem(1, args.heads, args.seq, args.seq, args.head_dim, dtype))
    for name in args.masks.split(","):
        mask = MASKS[name](args.seq)
        choice = choose(problem, mask)
        major, minor = target_capability()  # the H100's without a GPU
        arch = f"sm_{major}{minor}" + choice.template.arch_features
        compiled = compile_many([(choice.template.render(problem, choice.params), arch)])
        if compiled[0]:
            raise SystemExit(f"{name}: the one-GPU kernel did not compile: {compiled[0]}")
        for world in (int(w) for w in args.compile_only.split(",")):
            count = sum(precompile(mask, args.seq, world, heads=args.heads, head_dim=args.head_dim, dtype=dtype,
                                   overlap=overlap) for overlap in (True, False))
            print(f"{name}: CP = {world}, with and without overlap: {count} kernels compiled or cached", flush=True)
    return 0


def _distance(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


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
