"""Data-parallel inference on the GPUs of a node: one process per GPU, each compiling the same model
with stof-cc, every rank's stage 2 measuring on its own GPU into one shared tuning database.

    torchrun --nproc-per-node 2 examples/multi_gpu.py [--database /shared/tuning.sqlite]
                                                       [--layers 4] [--batch 4] [--seq 1024] [--no-peer]

Each rank takes GPU ``LOCAL_RANK`` (ranks beyond the node's GPU count share them, round robin:
the database sharing can be tried on one GPU, the throughput cannot), builds the same GPT-2-style
decoder (seed 0, fp16), compiles it with `stof_cc.compile(tune=True, database=...)` (SQLite with
WAL: concurrent writers wait for the lock, nothing is lost; the file must be on a disk local to
the node, since SQLite's WAL does not work over a network file system: one database per node),
checks its output against fp32 eager on its GPU, and times it beside `torch.compile` in its default
mode and with CUDA graphs ("reduce-overhead"), each checked the same way, all ranks timing at once;
the faster correct mode is the peer (default mode alone, an earlier version's peer, flattered stof-cc). Rank 0 prints one line per rank and the ranks' total tokens per second.
Run it twice with the same database: the second launch compiles warm, measuring nothing on any
rank ("groups measured: 0").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2_block import GPT2Block  # noqa: E402

import stof_cc  # noqa: E402


def median_ms(fn, repeats: int = 50) -> float:
    """Median of CUDA-event times after warm-up, on the current device."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def run_rank(args, rank: int, local_rank: int) -> dict:
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same weights on every rank
    model = torch.nn.Sequential(*(GPT2Block(768, 12, args.seq) for _ in range(args.layers))).eval()
    model = model.to(device).half()
    x = torch.randn(args.batch, args.seq, 768, device=device, dtype=torch.float16)
    with torch.no_grad():
        want = model.float()(x.float())
        model.half()
    log = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(log):  # stof_cc.compile reports each group it measures there
        compiled = stof_cc.compile(model, (x,), tune=True, database=args.database)
    row = {"rank": rank, "device": str(device), "compile_s": time.perf_counter() - started,
           "measured": log.getvalue().count("stof_cc.compile: tuned")}
    other = [line for line in log.getvalue().splitlines() if line.strip() and not line.startswith(("stof_cc.compile: tuned", "   "))]
    if other:  # warnings (a kernel that did not compile, ...) stay visible
        print("\n".join(f"rank {rank}: {line}" for line in other), file=sys.stderr)
    with torch.no_grad():
        got = compiled(x)
        row["error"] = float((got.float() - want).norm() / want.norm())
        peers = {}
        if not args.no_peer:  # Inductor in its default mode and with CUDA graphs: the best correct one is the peer
            for mode in ("default", "reduce-overhead"):
                torch._dynamo.reset()
                peer = torch.compile(model, mode=mode, dynamic=False)
                out = peer(x).float()
                peer_error = float((out - want).norm() / want.norm())
                row[f"torch_compile_{mode}_error"] = peer_error
                if peer_error < 1e-2:
                    peers[mode] = peer
        barrier()  # every rank compiled: the ranks time together
        row["stof_ms"] = median_ms(lambda: compiled(x))
        for mode, peer in peers.items():
            barrier()
            row[f"torch_compile_{mode}_ms"] = median_ms(lambda peer=peer: peer(x))
        if peers:
            row["torch_compile_ms"] = min(row[f"torch_compile_{mode}_ms"] for mode in peers)
    row["tokens"] = args.batch * args.seq
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", default=str(Path(tempfile.gettempdir()) / "stof-multi-gpu.sqlite"),
                        help="the tuning database the node's ranks share (on a local disk)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--no-peer", action="store_true", help="skip torch.compile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("multi_gpu.py needs CUDA GPUs", file=sys.stderr)
        return 2
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:  # gloo: barriers and plain Python objects, no GPU collectives needed
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        row = run_rank(args, rank, local_rank)
    except Exception as exc:  # reported by rank 0; the other ranks are not left waiting
        row = {"rank": rank, "device": "?", "failed": f"{type(exc).__name__}: {exc}"}
    rows = [row]
    if world > 1:
        rows = [None] * world
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
    if rank == 0:
        failed = [r for r in rows if "failed" in r]
        for r in failed:
            print(f"rank {r['rank']} failed: {r['failed']}", file=sys.stderr)
        if failed:
            return 1
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()
        for r in rows:
            peer = "".join(f", torch.compile {mode} {r[f'torch_compile_{mode}_ms']:.3f} ms"
                           for mode in ("default", "reduce-overhead") if f"torch_compile_{mode}_ms" in r)
            peer += "".join(f", torch.compile {mode} WRONG ({r[f'torch_compile_{mode}_error']:.1e})"
                            for mode in ("default", "reduce-overhead")
                            if not r.get(f"torch_compile_{mode}_error", 0.0) < 1e-2)
            print(f"rank {r['rank']} on {r['device']}: compile {r['compile_s']:.1f} s, groups measured: "
                  f"{r['measured']}, relative error {r['error']:.1e}, stof-cc {r['stof_ms']:.3f} ms{peer}")
        stof = sum(r["tokens"] / r["stof_ms"] * 1e3 for r in rows)
        line = f"all ranks: stof-cc {stof:,.0f} tokens/s"
        if all("torch_compile_ms" in r for r in rows):
            line += (f", torch.compile (its faster correct mode per rank) "
                     f"{sum(r['tokens'] / r['torch_compile_ms'] * 1e3 for r in rows):,.0f} tokens/s")
        print(line + (" (ranks share GPUs: not a throughput)" if shared else ""))
        if any(not r["error"] < 1e-2 for r in rows):
            print("a rank's output does not match eager", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
