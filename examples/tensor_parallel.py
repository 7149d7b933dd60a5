"""Tensor-parallel inference with stof-cc: a Llama-shaped decoder split over the GPUs of a node with
torch.distributed's `parallelize_module`, then `torch.compile(model, backend="stof_cc")`.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py [--hidden 8192] [--heads 64] [--kv-heads 8]
                                                            [--ffn 28672] [--layers 2] [--seq 4096]
                                                            [--dtype float16] [--no-peer] [--profile [--trace DIR]]
                                                            [--host-profile PREFIX] [--cpu]

Each rank builds the same random-weight model (transformers' `LlamaModel` from a config, seed 0),
shards it Megatron-style over a 1-D `DeviceMesh` of all ranks (q/k/v and gate/up column-wise,
o and down row-wise: one all-reduce after the attention and one after the MLP), and compiles it
with the stof_cc backend: dynamo hands over each rank's graph, AOTAutograd turns its DTensors into
local shards and functional collectives, and stof-cc fuses and generates the kernels around the
collectives, which run in NCCL through torch, or, at two ranks, by the GEMM's mirrored stores into the
other rank's symmetric memory (`STOF_CC_PEER_EXCHANGE=0`: NCCL; docs/torch_compile.md, "Tensor parallelism"). Rank 0
checks the output against the unsharded model run eagerly on its GPU in the same dtype, and prints
that model's own distance from fp32 (at the bar shape the sharded model run eagerly in fp16 is
0.14 from fp32 with these random weights: that is fp16's, not stof-cc's). Every rank times stof-cc
beside `torch.compile` (Inductor, default mode and "reduce-overhead") of the same sharded model.
``--cpu`` runs on gloo ranks with tiny defaults (a smoke test; its times mean nothing). The
defaults are issue 37's bar shape (Llama-70B's layer: hidden 8192, 64 query / 8 KV heads, FFN
28672), B = 1, S = 4096.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import stof_cc  # noqa: F401  (registers the backend name from a checkout)

LAYER_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
              "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
              "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
              "mlp.down_proj": RowwiseParallel()}


def llama(args) -> torch.nn.Module:
    """The random-weight model (no embedding is used: the input is hidden states)."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=args.ffn, num_hidden_layers=args.layers, vocab_size=128,
                         max_position_embeddings=max(4096, args.seq))
    torch.manual_seed(0)
    return LlamaModel._from_config(config, attn_implementation="sdpa").eval()


def shard(model: torch.nn.Module, world: int, device_type: str) -> torch.nn.Module:
    """Each decoder layer's projections split over a mesh of every rank."""
    mesh = init_device_mesh(device_type, (world,))
    for layer in model.layers:
        parallelize_module(layer, mesh, LAYER_PLAN)
    return model


def median_ms(fn, device: torch.device, repeats: int = 20) -> float:
    """Median wall time of ``fn`` after warm-up, every rank in step (a barrier before each call):
    one call from an idle GPU to its last kernel, the host's entry included."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def host_ms(fn, device: torch.device, repeats: int = 10) -> tuple[float, float]:
    """(median host time of one call from an idle GPU: how long ``fn`` takes to return, which is
    the launch work; GPU time per call of ``2 x repeats`` calls back to back, between CUDA events
    recorded once three calls ahead of them are queued: the host's entry hidden under the previous
    call's kernels, as in a serving loop, and neither the first call's entry nor the ranks' skew
    leaving the barrier counted, which a wall clock around the calls from an idle GPU did)."""
    entry = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        entry.append((time.perf_counter() - started) * 1e3)
        torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda.synchronize(device)
    for _ in range(3):  # queued ahead: the GPU is busy from here on
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(2 * repeats):
        fn()
    end.record()
    end.synchronize()
    return sorted(entry)[len(entry) // 2], start.elapsed_time(end) / (2 * repeats)


def host_profile(fn, device: torch.device, path: str, calls: int = 10) -> None:
    """cProfile of ``calls`` calls on this rank (a synchronize after each, outside the profile's
    functions of interest: it shows as one line), written to ``path`` sorted by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    for _ in range(calls):
        dist.barrier()
        torch.cuda.synchronize(device)
        profiler.enable()
        fn()
        profiler.disable()
    torch.cuda.synchronize(device)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    with open(path, "w") as out:
        out.write(f"{calls} calls\n{text.getvalue()}")


KERNEL_KINDS = (("NCCL", ("nccl",)), ("GEMM", ("gemm", "nvjet", "cutlass", "xmma")), ("attention", ("stof_attn", "attention", "flash", "fmha")))


def kernel_split(fn, trace: str | None, calls: int = 5) -> str:
    """Kernel time per call of ``fn`` by kind (torch.profiler, every rank in step). NCCL's kernels
    include their wait for the other ranks: an upper bound on what the collectives cost. The ranks
    meet at a barrier inside the profiler's warm-up step, which is not recorded: each rank starts
    its profiler at its own time, and a barrier before it left the first all-reduce waiting for the
    slowest (10 ms, more than all the calls' collectives together). With ``trace``, each rank also
    writes its timeline there (``rank<r>.json``, Chrome trace format)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    recorded = []

    def ready(prof) -> None:  # called once the recorded step ends
        recorded.append(prof.key_averages())
        if trace:
            os.makedirs(trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace, f"rank{dist.get_rank()}.json"))

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=1, active=1), on_trace_ready=ready) as prof:
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        prof.step()  # the recorded step starts with every rank in step
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        prof.step()
    totals = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for event in recorded[0]:
        if event.device_type != torch.autograd.DeviceType.CUDA or event.is_user_annotation \
                or event.key.startswith("ProfilerStep"):  # kernels only: not the host's events, nor the GPU
            continue  # ranges of the profiler's step and of each "nccl:all_reduce" (those counted NCCL twice)
        us = getattr(event, "self_device_time_total", 0.0)
        name = event.key.lower()
        kind = next((kind for kind, marks in KERNEL_KINDS if any(mark in name for mark in marks)), "other")
        totals[kind] += us
    return ", ".join(f"{kind} {us / calls / 1e3:.2f}" for kind, us in totals.items()) + " ms of kernels per call"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU, tiny defaults (a smoke test)")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--no-peer", action="store_true", help="skip torch.compile (Inductor)")
    parser.add_argument("--profile", action="store_true",
                        help="also print, per rank, each implementation's kernel time per call split into NCCL, GEMM, attention "
                             "and the rest (torch.profiler; GPUs only)")
    parser.add_argument("--trace", metavar="DIR", help="with --profile: write each rank's profiled stof-cc calls to "
                                                       "DIR/rank<r>.json (Chrome trace format)")
    parser.add_argument("--host-profile", metavar="PREFIX", help="write a cProfile of ten calls of each implementation per rank "
                                                                  "to PREFIX.<implementation>.rank<r>.txt (GPUs only)")
    args = parser.parse_args()
    sizes = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq": 32} if args.cpu else \
        {"hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "seq": 4096}
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not args.cpu and not torch.cuda.is_available():
        print("tensor_parallel.py needs CUDA GPUs (or --cpu for gloo ranks on the CPU)", file=sys.stderr)
        return 2
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32 if args.cpu else getattr(torch, args.dtype)
    if args.heads % world or args.kv_heads % world or args.ffn % world:
        print(f"heads {args.heads}, KV heads {args.kv_heads} and FFN {args.ffn} must divide by {world} ranks",
              file=sys.stderr)
        return 2
    torch.manual_seed(1)
    x = torch.randn(1, args.seq, args.hidden, device=device, dtype=dtype)
    started = time.perf_counter()

    def progress(what: str) -> None:  # rank 0 says what it is doing: model building and compiling take minutes
        if rank == 0:
            print(f"[{time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    with torch.no_grad():
        want = exact = None
        if rank == 0:  # the unsharded model run eagerly on one GPU: in the same dtype (the bar), and in fp32
            progress("building the unsharded reference model and running it eagerly")
            whole = llama(args).to(device)
            if args.seq <= 8192:  # fp32 attention with grouped heads runs SDPA's math path: S x S scores per head
                exact = whole(inputs_embeds=x.float()).last_hidden_state
            want = whole.to(dtype)(inputs_embeds=x).last_hidden_state.float()
            del whole
        progress(f"building the model and sharding it over {world} ranks")
        model = shard(llama(args).to(device, dtype), world, device.type)
        run = torch.compile(model, backend="stof_cc", dynamic=False)
        progress("first call: dynamo traces, stof-cc fuses, generates, compiles and tunes each rank's graph")
        got = run(inputs_embeds=x).last_hidden_state
        progress("timing stof-cc")
        line = f"rank {rank}: stof-cc {median_ms(lambda: run(inputs_embeds=x), device):.2f} ms"
        if device.type == "cuda":
            line += " (host entry {:.2f} ms, back to back {:.2f} ms per call)".format(
                *host_ms(lambda: run(inputs_embeds=x), device))
        if args.host_profile and device.type == "cuda":
            host_profile(lambda: run(inputs_embeds=x), device, f"{args.host_profile}.stof_cc.rank{rank}.txt")
        if args.profile and device.type == "cuda":
            line += f" ({kernel_split(lambda: run(inputs_embeds=x), args.trace)})"
        if not args.no_peer:  # Inductor in its default mode and with CUDA graphs; the faster is the peer
            for mode in ("default", "reduce-overhead"):
                progress(f"compiling and timing torch.compile (Inductor, {mode})")
                torch._dynamo.reset()
                peer = torch.compile(model, mode=mode, dynamic=False)
                out = peer(inputs_embeds=x).last_hidden_state.float()
                line += f", torch.compile {mode} {median_ms(lambda peer=peer: peer(inputs_embeds=x), device):.2f} ms"
                if device.type == "cuda":
                    line += " (host entry {:.2f} ms, back to back {:.2f} ms per call)".format(
                        *host_ms(lambda peer=peer: peer(inputs_embeds=x), device))
                if args.profile and device.type == "cuda":
                    line += f" ({kernel_split(lambda peer=peer: peer(inputs_embeds=x), None)})"
                if args.host_profile and device.type == "cuda":
                    host_profile(lambda peer=peer: peer(inputs_embeds=x), device,
                                 f"{args.host_profile}.inductor_{mode}.rank{rank}.txt")
                if want is not None:  # checked as stof-cc is: a peer counts only where it is right
                    peer_error = float((out - want).norm() / want.norm())
                    line += f" (error {peer_error:.1e}{'' if peer_error < 1e-2 else ': WRONG, not a peer'})"
    error = None if want is None else float((got.float() - want).norm() / want.norm())
    drift = None if exact is None else float((want - exact).norm() / exact.norm())
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print(f"TP = {world}, hidden {args.hidden}, {args.heads} / {args.kv_heads} heads, FFN {args.ffn}, "
              f"{args.layers} layers, B = 1, S = {args.seq}, {dtype}, on {device.type}")
        print("\n".join(lines))
        print(f"relative error against the unsharded model (eager, one GPU, {dtype}): {error:.1e}")
        print(f"(that model's own distance from fp32: {drift:.1e})" if drift is not None else
              "(its distance from fp32 not computed above S = 8192: fp32 SDPA would hold S x S scores per head)")
    torch._dynamo.reset()  # Inductor's CUDA graphs captured NCCL too: freed before the group is destroyed
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees
    reset_cudagraph_trees()
    dist.destroy_process_group()
    return 0 if error is None or error < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
