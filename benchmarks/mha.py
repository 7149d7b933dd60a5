"""The MHA grid of benchmarks/WORKLOADS.md: stof-cc's attention beside its peers, in one process.

Per case (mask, S): B = 8 for S <= 512 else 4096 // S (at least 1), H = 12, D = 64, fp16,
random normal inputs (`--heads`, `--head-dim`, `--dtype`, `--batch` change them: the D = 128 grid
is `--heads 16 --head-dim 128 --dtype bfloat16`). Every implementation is first checked against
the fp32 torch reference (above MAX_DENSE_SEQ on 256 sampled query rows, the dense mask being
too large); only correct peers count. Peers, as their users run them (WORKLOADS.md):
SDPA with the boolean mask (up to MAX_DENSE_SEQ), SDPA `is_causal` under the FlashAttention and
the cuDNN backends (causal), and `torch.compile(flex_attention)` with the mask_mod a user writes
(`stof_cc.masks.workloads.user_mask_mod`); where FlashAttention-4 imports (`flash_attn.cute`,
staged on the lent machine by ../shared/device/stage_fa4.sh), also FA4's `flash_attn_func`
(causal, and the sliding window as `window_size=(w, w)`) on [B, S, H, D] tensors and Flex with
`kernel_options={"BACKEND": "FLASH"}` (FA4's kernels, block-sparse) for every mask. The floor: the
fastest dense kernel (SDPA without a mask under the flash and cuDNN backends, and FA4 without a
mask where it imports) times the mask's density; each row reports stof-cc's
fraction of it. Times are medians of `triton.testing.do_bench` after warm-up (stof-cc's kernel is
compiled and its mask converted before timing, as a user's second call would find them), taken in
`--rounds` rounds (default 3) with every implementation in turn, the median of its rounds kept: timed
once each, the first case of a process read up to 30% slow. Prints
one row per case, then the geomean; `--append` adds the table to the work log (benchmarks/history/) with date,
GPU and versions. Long context: `--seqs 32768,131072 --masks causal,sliding,document`.

`--tune` runs stage 2 of the search first (it measures the survivors of stage 1: 8 of 41 here). `--sweep` measures every
candidate of the search space with stage 2's own timer (kernel time alone: CUDA events behind a
stream sleep, median of 20, inputs rotated) and reports where the model's choice ranks; with
`--tune`, it also reports how far stage 2's winner is from this exhaustive best, both timed the
same way. `--no-peers` skips the peers (for tuning evidence only).

    python benchmarks/mha.py [--seqs 128,2048] [--masks causal,sliding] [--heads 12 --head-dim 64 --dtype float16]
                             [--batch B] [--rounds N] [--tune] [--sweep] [--no-peers] [--json FILE] [--append]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fit_cost_model import spearman  # noqa: E402
from kernel_timing import ROUNDS, take_turns  # noqa: E402
from work_log import append_to_work_log  # noqa: E402  (benchmarks/, the script's folder)

from stof_cc.ir.reference import masked_attention, relative_error  # noqa: E402
from stof_cc.masks.workloads import (  # noqa: E402
    GRID_HEAD_DIM,
    GRID_HEADS,
    GRID_MASKS,
    GRID_SEQS,
    grid_batch,
    grid_mask,
    grid_window,
    user_mask_mod,
)
from stof_cc.runtime.attention import attention  # noqa: E402
from stof_cc.templates.attention import config_label, problem_of  # noqa: E402
from stof_cc.tune.attention import launched_choice  # noqa: E402
from stof_cc.tune.tune_attention import tune_attention  # noqa: E402

TOLERANCE = 1e-2  # relative error (Frobenius) for fp16
MAX_DENSE_SEQ = 16384  # above, no dense S x S mask: no SDPA-with-mask peer, a sampled reference
SAMPLED_ROWS = 256


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def fa4_available() -> bool:
    """FlashAttention-4 (flash-attn-4's CuTe DSL kernels) imports: ../shared/device/stage_fa4.sh
    stages it on the lent machine."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the peer is absent, and is said so
        return False
    return True


def fa4_peer(**options):
    """FA4's `flash_attn_func` as its users call it, on [B, S, H, D] tensors: the inputs are laid
    out that way once per tensor (not timed), the output read back as a [B, H, S, D] view."""
    from flash_attn.cute import flash_attn_func

    laid_out = {}

    def bshd(t):
        key = (t.data_ptr(), tuple(t.shape))
        if key not in laid_out:
            laid_out[key] = t.transpose(1, 2).contiguous()
        return laid_out[key]

    def run(q, k, v):
        out = flash_attn_func(bshd(q), bshd(k), bshd(v), **options)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return run


def document_length(seq: int) -> int:
    """The grid's document mask: documents of max(128, S // 4) positions (WORKLOADS.md)."""
    return max(128, seq // 4)


def documents_as_batch(seq: int):
    """SDPA (its fastest kernel: no mask) over the grid's equal documents as a batch: [B, H, S, D]
    viewed as [B, H x S / L, L, D], no copy. What a user with equal-length documents runs, and
    exactly the mask's answer (at S = 128 one document: dense attention)."""
    length = document_length(seq)

    def run(q, k, v):
        b, h, s, d = q.shape
        out = F.scaled_dot_product_attention(*(t.view(b, h * (s // length), length, d) for t in (q, k, v)))
        return out.view(b, h, s, d)
    return run


def fa4_documents(seq: int):
    """FA4's `flash_attn_varlen_func` with the documents' cu_seqlens, as packed-sequence users call
    it, on [B x S, H, D] tensors laid out once per tensor (not timed)."""
    from flash_attn.cute import flash_attn_varlen_func

    length, laid_out = document_length(seq), {}

    def packed(t):
        key = (t.data_ptr(), tuple(t.shape))
        if key not in laid_out:
            laid_out[key] = t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).contiguous()
        return laid_out[key]

    def run(q, k, v):
        b, h, s, d = q.shape
        bounds = torch.arange(0, b * s + 1, length, dtype=torch.int32, device=q.device)
        out = flash_attn_varlen_func(packed(q), packed(k), packed(v), cu_seqlens_q=bounds, cu_seqlens_k=bounds,
                                     max_seqlen_q=length, max_seqlen_k=length)
        return (out[0] if isinstance(out, tuple) else out).view(b, s, h, d).transpose(1, 2)
    return run


def flex_peer(name, batch, heads, seq, kernel_options=None):
    """torch.compile(flex_attention) with the user's mask_mod; create_block_mask compiled above
    MAX_DENSE_SEQ, as FlexAttention's docs advise for long sequences. ``kernel_options``
    ``{"BACKEND": "FLASH"}`` runs it on FA4's kernels (block-sparse)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = flex_peer.compiled
    if compiled is None:
        torch._dynamo.config.recompile_limit = 1000
        torch._dynamo.config.cache_size_limit = 1000
        # dynamic=False: the mask_mods capture sizes (a window), which automatic dynamic shapes turn
        # into SymInts after a recompile, and FA4's kernels refuse those ("NYI: ... captures a
        # dynamic scalar"; every FLASH row from the second window on, 2026-11-26)
        compiled = flex_peer.compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = create_block_mask(user_mask_mod(name, seq, "cuda"), None, None, seq, seq, device="cuda",
                                   _compile=seq > MAX_DENSE_SEQ)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, kernel_options=kernel_options)


flex_peer.compiled = None


def under(backend, **kwargs):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return run


def peers(name, dense, batch, heads, seq):
    out = {}
    if dense is not None:
        out["sdpa_mask"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    if name == "causal":
        out["flash_causal"] = under(SDPBackend.FLASH_ATTENTION, is_causal=True)
        out["cudnn_causal"] = under(SDPBackend.CUDNN_ATTENTION, is_causal=True)
    if name == "document":  # equal, aligned documents: dense kernels per document are correct peers
        out["sdpa_documents"] = documents_as_batch(seq)  # (missing before: found by review)
        if fa4_available():
            out["fa4_varlen"] = fa4_documents(seq)
    flex = {"flex": None}
    if fa4_available():  # FA4 itself where it has the mask, and FA4's kernels under Flex for every mask
        if name == "causal":
            out["fa4"] = fa4_peer(causal=True)
        elif name == "sliding":
            w = grid_window(seq)
            out["fa4"] = fa4_peer(window_size=(w, w))  # |q - k| <= w, the grid's sliding mask
        flex["flex_flash"] = {"BACKEND": "FLASH"}
    for label, options in flex.items():
        try:
            out[label] = flex_peer(name, batch, heads, seq, options)
        except Exception as exc:  # record why a peer is missing rather than dropping it silently
            print(f"  {label} unavailable for {name} S={seq}: {type(exc).__name__}: {exc}")
    return out


def dense_floors() -> dict:
    """The dense kernels whose time x density is the floor, made per case (FA4's keeps the
    case's inputs laid out as [B, S, H, D] until the case ends)."""
    floors = {"flash": under(SDPBackend.FLASH_ATTENTION), "cudnn": under(SDPBackend.CUDNN_ATTENTION)}
    if fa4_available():
        floors["fa4"] = fa4_peer()
    return floors


def sampled_reference(q, k, v, desc, rows):
    """The fp32 reference on the query rows ``rows`` only: their mask rows evaluated directly."""
    b, h = q.shape[:2]
    index = torch.arange
    allowed = desc.mask_mod_for(q.shape[2], k.shape[2], b, h)(
        index(b, device=q.device).view(-1, 1, 1, 1), index(h, device=q.device).view(1, -1, 1, 1),
        rows.view(1, 1, -1, 1), index(k.shape[2], device=q.device).view(1, 1, 1, -1))
    return masked_attention(q[:, :, rows], k, v, allowed)


def run_case(name: str, seq: int, sweep: bool, tune: bool = False, with_peers: bool = True,
             heads: int = GRID_HEADS, d: int = GRID_HEAD_DIM, dtype: torch.dtype = torch.float16,
             batch: int | None = None, rounds: int = ROUNDS) -> dict:
    batch = grid_batch(seq) if batch is None else batch
    desc = grid_mask(name, seq)
    density = desc.block_mask(seq, seq, 128, 128).element_density
    attended = density * seq * seq * batch * heads
    dense = desc.to_dense(seq, seq).cuda() if seq <= MAX_DENSE_SEQ else None
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=dtype, generator=gen)
               for _ in range(3))
    if dense is not None:
        rows, ref = slice(None), masked_attention(q, k, v, dense)
    else:
        rows = torch.randperm(seq, device="cuda", generator=gen)[:SAMPLED_ROWS].sort().values
        ref = sampled_reference(q, k, v, desc, rows)
    row = {"mask": name, "seq": seq, "batch": batch, "heads": heads, "head_dim": d, "dtype": str(dtype),
           "density": density}

    problem = problem_of(q, k, v)
    if tune:  # stage 2: measure stage 1's survivors and adopt the fastest (no database: every case measures)
        report = tune_attention(q, k, v, desc)
        row["tune"] = {"candidates": report.candidates, "measured": report.measured, "seconds": report.seconds,
                       "winner_model_rank": report.winner_model_rank, "winner_us": report.winner_us,
                       "winner": config_label(report.winner.params)}
    launched, choice = launched_choice(problem, desc)  # what runs: a dilated window as strided attentions
    ours = lambda: attention(q, k, v, desc)  # noqa: E731
    row["stof_err"] = relative_error(ours()[:, :, rows], ref)
    row["kernel"] = config_label(choice.params)

    timers = {"stof": lambda: bench(ours)}  # stof-cc, the correct peers and the dense floors, timed in turns
    row["peers"] = {}
    for peer, fn in (peers(name, dense, batch, heads, seq) if with_peers else {}).items():
        try:
            err = relative_error(fn(q, k, v)[:, :, rows], ref)
            row["peers"][peer] = {"ms": math.inf, "err": err, "ok": err < TOLERANCE}
            if err < TOLERANCE:
                timers[peer] = lambda fn=fn: bench(lambda: fn(q, k, v))
        except Exception as exc:
            row["peers"][peer] = {"ms": math.inf, "err": math.inf, "ok": False, "error": str(exc)[:200]}
    floors = dense_floors() if with_peers else {}
    timers |= {f"dense {label}": lambda fn=fn: bench(lambda: fn(q, k, v)) for label, fn in floors.items()}
    times, errors = take_turns(timers, rounds)
    for label, error in errors.items():  # a peer or dense backend that fails while timed is named
        print(f"  {label} failed at S={seq}: {error[:160]}")
    row["stof_ms"] = times["stof"]
    row["tflops"] = 4 * attended * d / (row["stof_ms"] * 1e-3) / 1e12
    for peer, result in row["peers"].items():
        result["ms"] = times.get(peer, math.inf)
        if peer in errors:
            result.update(ok=False, error=errors[peer])
    if with_peers:
        row["dense_ms"] = {label: times[f"dense {label}"] for label in floors}
        row["floor_ms"] = min(row["dense_ms"].values()) * density
        row["floor_fraction"] = row["floor_ms"] / row["stof_ms"]
        correct = [p["ms"] for p in row["peers"].values() if p["ok"]]
        row["best_peer_ms"] = min(correct) if correct else math.inf
        row["speedup"] = row["best_peer_ms"] / row["stof_ms"] if row["stof_err"] < TOLERANCE else 0.0

    if sweep:  # the exhaustive search: every candidate, stage 2's timer (it adopts its winner: after stof_ms)
        exhaustive = tune_attention(q, k, v, desc, top_k=len(choice.estimates), max_share=1.0)
        measured = [{"template": o.candidate.template.name, "params": o.candidate.params, "ok": not o.failure,
                     "ms": o.micros / 1e3, "estimate_us": o.candidate.estimate_us} for o in exhaustive.outcomes]
        by_time = sorted(measured, key=lambda m: m["ms"])
        labels = [config_label(m["params"]) for m in by_time]
        model_order = [config_label(e.params) for e in choice.estimates]
        row["sweep"] = measured
        row["residues"] = launched.residues  # the sweep measured the launched form: d strided attentions where > 1
        row["best_ms"] = by_time[0]["ms"]
        row["best_kernel"] = labels[0]
        row["choice_rank_measured"] = 1 + labels.index(model_order[0])
        row["choice_ms"] = by_time[row["choice_rank_measured"] - 1]["ms"]
        row["best_rank_model"] = 1 + model_order.index(labels[0])
        row["spearman"] = spearman([m["estimate_us"] for m in measured if m["ok"]],
                                   [m["ms"] for m in measured if m["ok"]])
        if tune:
            row["tune"]["winner_sweep_ms"] = by_time[labels.index(row["tune"]["winner"])]["ms"]
    return row


def format_table(rows: list[dict]) -> str:
    peer_names = ["sdpa_mask", "flash_causal", "cudnn_causal", "sdpa_documents", "fa4_varlen", "flex", "fa4", "flex_flash"]
    head = "| mask | S | B | stof ms | " + " | ".join(f"{p} ms" for p in peer_names) + \
           " | floor ms | of floor | speedup | TFLOP/s | kernel |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = []
        for p in peer_names:
            info = r["peers"].get(p)
            cells.append("-" if info is None else "error" if "error" in info
                         else f"{info['ms']:.4f}" + ("" if info["ok"] else " (wrong)"))
        stof = f"{r['stof_ms']:.4f}" + ("" if r["stof_err"] < TOLERANCE else " (WRONG)")
        floor = f"{r['floor_ms']:.4f} | {r['floor_fraction']:.0%}" if "floor_ms" in r else "- | -"
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        lines.append(f"| {r['mask']} | {r['seq']} | {r['batch']} | {stof} | " + " | ".join(cells) +
                     f" | {floor} | {speedup} | {r['tflops']:.0f} | {r['kernel']} |")
    tuned = [r for r in rows if "sweep" in r and "winner_sweep_ms" in r.get("tune", {})]
    if tuned:
        lines += ["", "| mask | S | stage 2 winner | its ms in the sweep | exhaustive best | best ms | ratio | "
                  "model rank of the winner | measured | Spearman |", "|" + "---|" * 10]
        for r in tuned:
            t = r["tune"]
            lines.append(f"| {r['mask']} | {r['seq']} | {t['winner']} | {t['winner_sweep_ms']:.4f} | {r['best_kernel']} | "
                         f"{r['best_ms']:.4f} | {t['winner_sweep_ms'] / r['best_ms']:.3f} | {t['winner_model_rank']} | "
                         f"{t['measured']} of {t['candidates']} | {r['spearman']:.2f} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    text = ""
    compared = [r for r in rows if "speedup" in r]
    if compared:
        geo = math.exp(sum(math.log(max(r["speedup"], 1e-9)) for r in compared) / len(compared))
        worst = min(compared, key=lambda r: r["speedup"])
        text = (f"geomean speedup over the best correct peer: {geo:.3f}x over {len(compared)} cases; "
                f"worst {worst['speedup']:.2f}x ({worst['mask']} S={worst['seq']})\n")
    causal = [r for r in compared if r["peers"].get("cudnn_causal", {}).get("ok")]
    if causal:
        text += "causal, stof-cc's time / cuDNN's causal time: " + ", ".join(
            f"S={r['seq']} {r['stof_ms'] / r['peers']['cudnn_causal']['ms']:.2f}" for r in causal) + "\n"
    sparse = [r for r in compared if r["seq"] >= 8192 and r["mask"] != "causal"]
    if sparse:
        low = min(sparse, key=lambda r: r["floor_fraction"])
        text += (f"sparse masks at S >= 8192: {low['floor_fraction']:.0%} of the floor at the lowest "
                 f"({low['mask']} S={low['seq']})\n")
    sweeps = [r for r in rows if "sweep" in r]
    if sweeps:
        text += (f"model's first choice within 5% of the exhaustive best in "
                 f"{sum(r['choice_ms'] <= 1.05 * r['best_ms'] for r in sweeps)}"
                 f"/{len(sweeps)} cases; median measured rank of the model's choice "
                 f"{_median([r['choice_rank_measured'] for r in sweeps])}; median Spearman correlation of "
                 f"estimates and times {_median([r['spearman'] for r in sweeps]):.2f}\n")
    tuned = [r for r in rows if "tune" in r]
    if tuned:
        share = max(r["tune"]["measured"] / r["tune"]["candidates"] for r in tuned)
        text += (f"stage 2 measured at most {share:.0%} of the candidates per case "
                 f"({sum(r['tune']['seconds'] for r in tuned):.0f} s in all)")
        both = [r for r in tuned if "sweep" in r]
        if both:
            ratios = [r["tune"]["winner_sweep_ms"] / r["best_ms"] for r in both]
            text += (f"; its winner, timed in the exhaustive sweep, is within 5% of the exhaustive best in "
                     f"{sum(x <= 1.05 for x in ratios)}/{len(both)} cases (worst {max(ratios):.3f}x)")
    return text.rstrip()


def _median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def _warm_gpu(seconds: float = 1.0) -> None:
    """Run the GPU busy for a while first, so the first case is not timed at idle clocks."""
    import time

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            x @ x
        torch.cuda.synchronize()


def environment() -> str:
    import triton

    return (f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, triton {triton.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default=",".join(map(str, GRID_SEQS)))
    parser.add_argument("--masks", default=",".join(GRID_MASKS))
    parser.add_argument("--sweep", action="store_true",
                        help="also measure every candidate with stage 2's timer (the exhaustive search)")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers (tuning evidence only)")
    parser.add_argument("--tune", action="store_true",
                        help="run stage 2 of the search (measure stage 1's survivors) before timing stof-cc")
    parser.add_argument("--heads", type=int, default=GRID_HEADS)
    parser.add_argument("--head-dim", type=int, default=GRID_HEAD_DIM)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--batch", type=int, help="instead of 4096 tokens per call")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="timing rounds, every implementation in turn (the median of its rounds)")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--append", action="store_true", help="append the table to the work log, benchmarks/history/")
    args = parser.parse_args()

    _warm_gpu()
    rows = []
    for seq in map(int, args.seqs.split(",")):
        for name in args.masks.split(","):
            row = run_case(name, seq, args.sweep, args.tune, with_peers=not args.no_peers, heads=args.heads,
                           d=args.head_dim, dtype=getattr(torch, args.dtype), batch=args.batch, rounds=args.rounds)
            rows.append(row)
            line = f"{name:>10} S={seq:<5} stof {row['stof_ms']:.4f} ms  [{row['kernel']}]"
            if "speedup" in row:
                line += (f"  best peer {row['best_peer_ms']:.4f} ms -> {row['speedup']:.2f}x, "
                         f"{row['floor_fraction']:.0%} of the floor")
            if "sweep" in row:
                line += f"  exhaustive best {row['best_ms']:.4f} ms [{row['best_kernel']}]"
            if "winner_sweep_ms" in row.get("tune", {}):
                line += f"  stage 2 winner {row['tune']['winner']} at {row['tune']['winner_sweep_ms']:.4f} ms in it"
            print(line, flush=True)
            if args.json:  # after every case, so a cut-off run keeps what it measured
                Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    table, text = format_table(rows), summary(rows)
    print("\n" + environment() + "\n" + table + "\n" + text)
    if args.append:
        append_to_work_log(f"\n## MHA grid ({environment()})\n\nCommand: `python benchmarks/mha.py"
                           f"{' --sweep' if args.sweep else ''}{' --tune' if args.tune else ''}`\n\n{table}\n\n{text}\n")


if __name__ == "__main__":
    main()
