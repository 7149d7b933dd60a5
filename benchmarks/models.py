"""Real models end to end (issue 20): HuggingFace families from configs with random weights.

    python benchmarks/models.py [--families bert,gpt2,...] [--dtype float16] [--batch 4] [--seq 1024]
                                [--layers 4] [--tiny] [--no-tune] [--no-peers] [--json out.json]

WORKLOADS.md's "Real models": hidden 768, 12 heads (decoders 12 query / 4 key-value heads),
``--layers`` layers, batch and sequence as given; encoders get right padding (the last quarter
of the second half of the batch), decoders an all-ones ``attention_mask``. ``--tiny`` builds
the small test configs instead (a correctness run). Each model's fp16/bf16 output is checked
against its fp32 eager output (relative error < 1e-2, on the real tokens) before timing; then
`stof_cc.compile` (CUDA graphs where the model allows), eager, `torch.compile` (default) and
`torch.compile(mode="reduce-overhead")` are timed in this process: medians of
`triton.testing.do_bench` after warm-up. A peer that fails is reported with its error, never
dropped. Needs an NVIDIA GPU, PyCUDA, nvcc and transformers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import stof_cc  # noqa: E402
from stof_cc.ir.reference import relative_error  # noqa: E402

TOLERANCE = 1e-2
ENCODERS = ("bert", "roberta", "distilbert", "vit", "t5")


def build(family: str, layers: int, tiny: bool):
    """(model, kwargs maker) for one family; the maker takes (batch, seq, device)."""
    import transformers as T

    if tiny:
        hidden, heads, kv, ffn, layers = 128, 4, 2, 256, 2  # head dim 32: the kernels run it
    else:
        hidden, heads, kv, ffn = 768, 12, 4, 3072
    common = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
              "intermediate_size": ffn, "vocab_size": 1000, "max_position_embeddings": 32768}
    decoder = {"num_key_value_heads": kv, **common}
    models = {
        "bert": lambda: T.BertModel(T.BertConfig(**common)),
        "roberta": lambda: T.RobertaModel(T.RobertaConfig(**{**common, "max_position_embeddings": 32770})),
        "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(n_layers=layers, dim=hidden, n_heads=heads,
                                                                   hidden_dim=ffn, vocab_size=1000,
                                                                   max_position_embeddings=32768)),
        "gpt2": lambda: T.GPT2Model(T.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=1000,
                                                 n_positions=32768, bos_token_id=0, eos_token_id=0)),
        "llama": lambda: T.LlamaModel(T.LlamaConfig(**decoder)),
        "mistral": lambda: T.MistralModel(T.MistralConfig(sliding_window=4096 if not tiny else 16, **decoder)),
        "qwen2": lambda: T.Qwen2Model(T.Qwen2Config(**decoder)),
        "vit": lambda: T.ViTModel(T.ViTConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                              intermediate_size=ffn, image_size=32 if tiny else 512,
                                              patch_size=8 if tiny else 16)),
        "t5": lambda: T.T5EncoderModel(T.T5Config(num_layers=layers, d_model=hidden, num_heads=heads,
                                                  d_kv=hidden // heads, d_ff=ffn, vocab_size=1000)),
    }
    torch.manual_seed(0)
    model = models[family]().eval()

    def inputs(batch: int, seq: int, device: str) -> dict:
        if family == "vit":
            size = model.config.image_size
            return {"pixel_values": torch.randn(batch, 3, size, size, device=device)}
        ids = torch.randint(0, 1000, (batch, seq), device=device)
        padding = torch.ones(batch, seq, dtype=torch.long, device=device)
        if family in ENCODERS:
            padding[batch // 2:, seq - seq // 4:] = 0  # right padding in half the batch
        return {"input_ids": ids, "attention_mask": padding}
    return model, inputs


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def real_tokens(out: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The outputs of real tokens only: padded positions are undefined in every implementation."""
    mask = kwargs.get("attention_mask")
    return out if mask is None else out[mask.bool()]


def run_family(family: str, args, database: Path) -> dict:
    dtype = getattr(torch, args.dtype)
    model, make = build(family, args.layers, args.tiny)
    model = model.cuda()
    kwargs = make(args.batch, args.seq, "cuda")
    with torch.no_grad():
        want = real_tokens(model(**kwargs).last_hidden_state, kwargs)
    half = model.to(dtype)
    row = {"family": family, "dtype": args.dtype, "batch": args.batch, "seq": args.seq, "peers": {}}
    with torch.no_grad():
        started = time.perf_counter()
        try:
            compiled = stof_cc.compile(half, (), kwargs, dtype=dtype, tune=not args.no_tune, database=database)
            row["compile_s"] = time.perf_counter() - started
            run = lambda: compiled(**kwargs).last_hidden_state  # noqa: E731
            row["stof_err"] = relative_error(real_tokens(run(), kwargs), want)
            row["stof_ms"] = bench(run)
            row["steps"] = compiled.explain()
        except Exception as exc:  # reported, not hidden
            row.update(stof_err=math.inf, stof_ms=math.inf, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        print(f"  {family}: stof-cc {row['stof_ms']:.3f} ms, error {row['stof_err']:.1e}"
              + (f" ({row['error']})" if "error" in row else f", compile {row['compile_s']:.1f} s"), flush=True)
        peers = {"eager": lambda: half(**kwargs).last_hidden_state} if not args.no_peers else {}
        for mode in ("default", "reduce-overhead") if not args.no_peers else ():
            module = torch.compile(half, mode=mode)
            peers[f"compile_{mode}"] = lambda m=module: m(**kwargs).last_hidden_state
        for label, fn in peers.items():
            try:
                err = relative_error(real_tokens(fn(), kwargs), want)
                row["peers"][label] = {"ms": bench(fn), "err": err, "ok": err < TOLERANCE}
            except Exception as exc:  # a peer that fails is named, not dropped
                row["peers"][label] = {"ms": math.inf, "err": math.inf, "ok": False, "error": str(exc)[:300]}
            print(f"  {family}: {label} {row['peers'][label]['ms']:.3f} ms, error {row['peers'][label]['err']:.1e}",
                  flush=True)
    correct = [p["ms"] for p in row["peers"].values() if p["ok"]]
    row["best_peer_ms"] = min(correct) if correct else math.inf
    row["speedup"] = row["best_peer_ms"] / row["stof_ms"] if row["stof_err"] < TOLERANCE else 0.0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="bert,roberta,distilbert,gpt2,llama,mistral,qwen2,vit,t5")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="the small test configs: a correctness run")
    parser.add_argument("--no-tune", action="store_true", help="compile with tune=False (stage 1's picks)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    database = Path(tempfile.mkdtemp(prefix="stof-models-")) / "tuning.sqlite"
    rows = []
    for family in args.families.split(","):
        rows.append(run_family(family, args, database))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    names = sorted({n for r in rows for n in r["peers"]})
    print(f"\n{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"B={args.batch} S={args.seq} layers={args.layers}{' (tiny)' if args.tiny else ''}")
    print("| family | stof ms (error) | " + " | ".join(f"{n} ms" for n in names) + " | speedup |")
    print("|" + "---|" * (len(names) + 3))
    for r in rows:
        cells = " | ".join(f"{r['peers'][n]['ms']:.3f}" + ("" if r["peers"][n]["ok"] else " (wrong)")
                           if n in r["peers"] else "-" for n in names)
        print(f"| {r['family']} | {r['stof_ms']:.3f} ({r['stof_err']:.1e}) | {cells} | {r['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
