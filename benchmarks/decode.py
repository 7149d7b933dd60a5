"""A generation step's attention (issue 36, item 2): one query per sequence against a KV cache, as
`generate()` runs it after the prefill, at a 7-8B decoder's heads (32 query / 8 KV heads, d = 128).

    python benchmarks/decode.py [--batch 1,8,32] [--keys 4096,32768] [--dtype bfloat16] [--json out.json]

Per (B, S_k, mask): q [B, 32, 1, 128] and a contiguous cache k, v [B, 8, S_k, 128] (a dynamic
cache's layout), the query at position S_k - 1. Masks: ``causal`` (no padding: every key),
``padding`` (the second half of the batch left-padded by a quarter of the keys, as generation pads),
``window`` (Mistral's sliding window of 4096 keys; only where S_k > 4096). Implementations:

- ``stof``: `stof_cc.backends.decode_launch.decode_attention`, the call `attn_implementation="stof_cc"`
  makes for a decode step (the band, the positions, the key padding);
- ``sdpa``: transformers' own `sdpa_attention_forward` with the mask its sdpa mask function gives
  that step (none without padding or window, so SDPA runs its flash kernel with ``enable_gqa``; else a
  boolean [B, 1, 1, S_k] mask, with the query heads packed per KV head): what ``attn_implementation="sdpa"`` runs;
- ``sdpa_window_cache`` (window rows): transformers' sdpa over the cache a sliding-window model
  keeps, the window's last 4096 keys, with no mask: what ``attn_implementation="sdpa"`` really reads
  for Mistral (its cache drops older keys), and what a stof-cc user's model reads too: on that cache
  the step is the ``causal`` row at S_k = 4096. The window rows' ``vs sdpa`` is against the faster
  of the two sdpa forms (an earlier version compared with the full-cache form only: found by review);
- ``flex``: `torch.compile(flex_attention)` with a block mask of the user's mask_mod (made before
  timing, as transformers' flex path reuses it across layers) and ``enable_gqa``.

Each is checked against the fp32 reference (relative error < 1e-2) and timed twice: ``gpu`` is the
median of `triton.testing.do_bench` (L2 flushed before each call: the cache is read from DRAM, as a
step over 32 layers reads it), ``wall`` the host's time per call over 200 calls back to back (what a
step costs where launching is slower than the kernels: the host's share). Needs an NVIDIA GPU,
PyCUDA, nvcc and transformers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stof_cc import masks  # noqa: E402
from stof_cc.backends.decode_launch import decode_attention  # noqa: E402
from stof_cc.ir.reference import relative_error  # noqa: E402

HEADS, KV_HEADS, DIM, WINDOW = 32, 8, 128, 4096
TOLERANCE = 1e-2


class _Layer(torch.nn.Module):
    """What transformers' sdpa function reads of the attention module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def allowed_keys(batch: int, seq_k: int, mask: str) -> torch.Tensor:
    """[B, S_k] bool: the keys the query at position S_k - 1 attends."""
    allowed = torch.ones(batch, seq_k, dtype=torch.bool, device="cuda")
    if mask == "padding":
        allowed[batch // 2:, :seq_k // 4] = False
    if mask == "window":
        allowed[:, :seq_k - WINDOW] = False  # Mistral's window: the last 4096 positions, its own included
    return allowed


def implementations(q, k, v, mask: str, allowed: torch.Tensor) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, seq_k = allowed.shape
    padding = allowed if mask == "padding" else None
    band = masks.sliding_window(WINDOW - 1, causal=True) if mask == "window" else masks.causal()
    layer = _Layer()
    hf_mask = None if mask == "causal" else allowed[:, None, None, :]

    def mask_mod(b, h, q_idx, kv_idx):  # the query sits at S_k - 1
        return allowed[b, kv_idx]

    block_mask = create_block_mask(mask_mod, batch, None, 1, seq_k, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    runs = {
        "stof": lambda: decode_attention(q, k, v, band, q_position=seq_k - 1, k_position=0, key_padding=padding),
        "sdpa": lambda: sdpa_attention_forward(layer, q, k, v, hf_mask, is_causal=False)[0].transpose(1, 2),
        "flex": lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True),
    }
    if mask == "window":  # what transformers runs for a sliding-window model: its cache keeps the window's keys
        k_window, v_window = (t[:, :, -WINDOW:].contiguous() for t in (k, v))  # only (found by review), no mask
        runs["sdpa_window_cache"] = lambda: sdpa_attention_forward(layer, q, k_window, v_window, None,
                                                                   is_causal=False)[0].transpose(1, 2)
    return runs


def reference(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    kf = k.float().repeat_interleave(HEADS // KV_HEADS, dim=1)
    vf = v.float().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) / DIM ** 0.5
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ vf


def wall_us(run, calls: int = 200) -> float:
    run()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def measure(batch: int, seq_k: int, mask: str, dtype: torch.dtype) -> dict:
    from triton.testing import do_bench

    q = torch.randn(batch, HEADS, 1, DIM, dtype=dtype, device="cuda")
    k, v = (torch.randn(batch, KV_HEADS, seq_k, DIM, dtype=dtype, device="cuda") for _ in range(2))
    allowed = allowed_keys(batch, seq_k, mask)
    want = reference(q, k, v, allowed)
    # the cache read from DRAM once per call: the bytes the step cannot avoid
    row = {"batch": batch, "keys": seq_k, "mask": mask, "cache_mb": 2 * k.numel() * k.element_size() / 1e6}
    for name, run in implementations(q, k, v, mask, allowed).items():
        try:
            error = relative_error(run().reshape(want.shape), want)
        except Exception as exc:  # noqa: BLE001
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            continue
        if error >= TOLERANCE:
            row[name] = {"error": f"relative error {error:.1e}"}
            continue
        row[name] = {"gpu_us": float(do_bench(run, warmup=10, rep=50, return_mode="median")) * 1e3,
                     "wall_us": statistics.median(wall_us(run) for _ in range(3)), "err": error}
    return row


def table(rows: list[dict]) -> str:
    names = ("stof", "sdpa", "flex", "sdpa_window_cache")

    def cell(r, name, key):
        got = r.get(name, {})
        return f"{got[key]:.1f}" if key in got else got.get("error", "-")[:30]

    lines = ["| B | S_k | mask | cache MB | GPU us stof / sdpa / flex / sdpa on the window's cache | stof TB/s | "
             "vs sdpa (best form) | vs flex | wall us stof / sdpa / flex / sdpa on the window's cache |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gpu = {n: r[n]["gpu_us"] for n in names if "gpu_us" in r.get(n, {})}
        if "sdpa_window_cache" in gpu:  # sdpa's best form: a window model's own cache
            gpu["sdpa"] = min(gpu.get("sdpa", float("inf")), gpu["sdpa_window_cache"])
        ratio = {n: f"{gpu[n] / gpu['stof']:.2f}x" if n in gpu and "stof" in gpu else "-" for n in ("sdpa", "flex")}
        bandwidth = f"{r['cache_mb'] / gpu['stof']:.2f}" if "stof" in gpu else "-"
        lines.append(f"| {r['batch']} | {r['keys']} | {r['mask']} | {r['cache_mb']:.0f} | "
                     + " / ".join(cell(r, n, "gpu_us") for n in names) + f" | {bandwidth} | {ratio['sdpa']} | "
                     f"{ratio['flex']} | " + " / ".join(cell(r, n, "wall_us") for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--keys", default="4096,32768")
    parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    parser.add_argument("--json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for batch in map(int, args.batch.split(",")):
        for seq_k in map(int, args.keys.split(",")):
            for mask in ("causal", "padding", "window"):
                if mask == "window" and seq_k <= WINDOW:
                    continue
                rows.append(measure(batch, seq_k, mask, dtype))
                print(rows[-1], flush=True)
    print(f"\n{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"H = {HEADS}, H_kv = {KV_HEADS}, d = {DIM}, one query per sequence")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
