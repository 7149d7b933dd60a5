"""Real models end to end (issue 20): HuggingFace families from configs with random weights.

    python benchmarks/models.py [--families bert,gpt2,...] [--dtype float16] [--size base|8b|serving|tiny]
                                [--batch B] [--seq S] [--layers L] [--no-tune] [--no-peers] [--no-backend]
                                [--db tuning.sqlite] [--json out.json]

WORKLOADS.md's "Real models": hidden 768, 12 heads (decoders 12 query / 4 key-value heads),
``--layers`` layers, batch and sequence as given; encoders get right padding (the last quarter
of the second half of the batch), decoders an all-ones ``attention_mask``. ``encoder_layer`` is
torch.nn's ``TransformerEncoder`` of ``TransformerEncoderLayer`` (batch first, GELU) with a
``src_key_padding_mask`` (``encoder_layer_nomask``: the same without one). ``--size`` picks the
dimensions and, unless given, batch, sequence and layers (`SIZES`): ``base`` (the above, B = 4,
S = 1024, 4 layers), ``8b`` (a 7-8B decoder layer: hidden 4096, 32 query / 8 key-value heads,
FFN 14336; B = 1, S = 4096, 2 layers; issue 34), ``tiny`` (the small test configs: a
correctness run) and ``serving``: hidden 1024, 16 heads, B = 64, S = 128, every eighth sequence
entirely padding (``attention_mask`` all 0: each implementation gives those rows the model's
own value, uniform attention in HF's masks), the whole output compared, padded positions
included. ``--tiny`` and ``--serving`` are the same as ``--size tiny`` / ``--size serving``.
Each model's fp16/bf16 output is checked
against its fp32 eager output on the real tokens before timing (relative error below 1e-2, or
below 1.25x eager's own error in that dtype where that is larger: at S = 16384 eager fp16 itself
is 1.1e-2 from fp32 on these random-weight models); then
`stof_cc.compile` (CUDA graphs where the model allows), the same model under
`torch.compile(backend=stof_cc.backend(...))` (its own column, not a peer), eager, `torch.compile`
(default) and `torch.compile(mode="reduce-overhead")` are timed in this process (for GPT-OSS, which has no
SDPA path, also transformers' FlexAttention path: `FLEX_PEERS`): medians of
`triton.testing.do_bench` after warm-up. Beside each row, the model's floor (benchmarks/floor.py:
its GEMMs in cuBLAS, its attention at the dense kernels' speed times the mask's density, the
rest of its bytes at 3 TB/s). A peer that fails is reported with its error, never
dropped. Needs an NVIDIA GPU, PyCUDA, nvcc and transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import stof_cc  # noqa: E402
from stof_cc.ir.reference import relative_error  # noqa: E402

TOLERANCE = 1e-2
# --size: (hidden, heads, key-value heads, FFN) and the default (batch, sequence, layers)
SIZES = {"base": ((768, 12, 4, 3072), (4, 1024, 4)),
         "8b": ((4096, 32, 8, 14336), (1, 4096, 2)),
         "serving": ((1024, 16, 4, 4096), (64, 128, 4)),
         "tiny": ((128, 4, 2, 256), (4, 64, 2))}  # head dim 32: the kernels run it
ENCODERS = ("bert", "roberta", "distilbert", "vit", "t5", "encoder_layer", "encoder_layer_nomask")


def build(family: str, layers: int, size: str = "base"):
    """(model, kwargs maker) for one family at ``size`` (`SIZES`); the maker takes (batch, seq, device)."""
    import transformers as T

    (hidden, heads, kv, ffn), _ = SIZES[size]
    tiny, serving = size == "tiny", size == "serving"
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
        "llama_eager": lambda: T.LlamaModel(T.LlamaConfig(attn_implementation="eager", **decoder)),
        "bloom": lambda: T.BloomModel(T.BloomConfig(n_layer=layers, hidden_size=hidden, n_head=heads, vocab_size=1000)),
        "falcon": lambda: T.FalconModel(T.FalconConfig(num_hidden_layers=layers, hidden_size=hidden,
                                                       num_attention_heads=heads, vocab_size=1000)),
        "cohere": lambda: T.CohereModel(T.CohereConfig(eos_token_id=0, pad_token_id=0, bos_token_id=0, **decoder)),
        "mistral": lambda: T.MistralModel(T.MistralConfig(sliding_window=4096 if not tiny else 16, **decoder)),
        "qwen2": lambda: T.Qwen2Model(T.Qwen2Config(**decoder)),
        "qwen3": lambda: T.Qwen3Model(T.Qwen3Config(head_dim=hidden // heads, **decoder)),
        "olmo2": lambda: T.Olmo2Model(T.Olmo2Config(**decoder)),
        "gemma3": lambda: T.Gemma3TextModel(T.Gemma3TextConfig(head_dim=hidden // heads,
                                                               sliding_window=4096 if not tiny else 16, **decoder)),
        "phi3": lambda: T.Phi3Model(T.Phi3Config(pad_token_id=0, **decoder)),
        # GPT-OSS: attention sinks, a 128-token window every other layer, eight experts (two per token)
        "gpt_oss": lambda: T.GptOssModel(T.GptOssConfig(head_dim=hidden // heads, sliding_window=128 if not tiny else 16,
                                                        num_local_experts=8, num_experts_per_tok=2, **decoder)),
        # mixtures of experts: Mixtral (8 experts as wide as the FFN, two per token) and Qwen3-MoE (fine-grained:
        # 16 experts a quarter as wide, four per token, as Qwen3-30B-A3B's proportions)
        "mixtral": lambda: T.MixtralModel(T.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **decoder)),
        "qwen3_moe": lambda: T.Qwen3MoeModel(T.Qwen3MoeConfig(head_dim=hidden // heads, num_experts=16, num_experts_per_tok=4,
                                                              moe_intermediate_size=ffn // 4, **decoder)),
        "vit": lambda: T.ViTModel(T.ViTConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                              intermediate_size=ffn, image_size=32 if tiny else 512,
                                              patch_size=8 if tiny else 16)),
        "t5": lambda: T.T5EncoderModel(T.T5Config(num_layers=layers, d_model=hidden, num_heads=heads,
                                                  d_kv=hidden // heads, d_ff=ffn, vocab_size=1000)),
        "encoder_layer": lambda: torch.nn.TransformerEncoder(  # torch.nn's own, as its users build it
            torch.nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, activation="gelu", batch_first=True),
            layers, enable_nested_tensor=False),
    }
    models["encoder_layer_nomask"] = models["encoder_layer"]
    torch.manual_seed(0)
    model = models[family]().eval()

    def inputs(batch: int, seq: int, device: str) -> dict:
        if family == "vit":
            size = model.config.image_size
            return {"pixel_values": torch.randn(batch, 3, size, size, device=device)}
        if family == "encoder_layer_nomask":  # WORKLOADS.md: nn.TransformerEncoderLayer without a mask too
            return {"src": torch.randn(batch, seq, hidden, device=device)}
        if family == "encoder_layer":  # True = padding, right padding in half the batch
            padded = torch.zeros(batch, seq, dtype=torch.bool, device=device)
            padded[batch // 2:, seq - seq // 4:] = True
            return {"src": torch.randn(batch, seq, hidden, device=device), "src_key_padding_mask": padded}
        ids = torch.randint(0, 1000, (batch, seq), device=device)
        padding = torch.ones(batch, seq, dtype=torch.long, device=device)
        if family in ENCODERS:
            padding[batch // 2:, seq - seq // 4:] = 0  # right padding in half the batch
        if serving:
            padding[::8] = 0  # every eighth sequence is all padding
        return {"input_ids": ids, "attention_mask": padding}
    return model, inputs


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


SERVING = False  # --serving: the whole output is compared, padded positions included


def real_tokens(out, kwargs: dict) -> torch.Tensor:
    """The hidden states of real tokens only (padded positions are the model's own business,
    except in the serving row, which compares them too: a fully padded sequence must get what
    the model gives it); ``out`` is a HF output (its ``last_hidden_state``) or a tensor."""
    out = getattr(out, "last_hidden_state", out)
    if SERVING:
        return out
    if kwargs.get("attention_mask") is not None:
        return out[kwargs["attention_mask"].bool()]
    if kwargs.get("src_key_padding_mask") is not None:
        return out[~kwargs["src_key_padding_mask"]]
    return out


@contextlib.contextmanager
def heads_repeated_sdpa():
    """SDPA with grouped K/V heads repeated first, for the fp32 reference: in fp32 only SDPA's
    math backend takes ``enable_gqa`` (HF passes it without a mask), and it holds every score
    (8 GiB and up per layer at S = 16384: the reference ran out of memory); the memory-efficient
    backend runs the repeated heads."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def repeated(q, k, v, *args, enable_gqa=False, **kwargs):
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        return sdpa(q, k, v, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = repeated
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


# Families whose users pick attn_implementation="flex_attention" over eager: GPT-OSS (no SDPA: its
# sinks), where transformers' FlexAttention path takes the sinks through the log-sum-exp
FLEX_PEERS = ("gpt_oss",)


def _with_attention(model: torch.nn.Module, implementation: str) -> torch.nn.Module:
    """A copy of ``model`` running transformers' ``implementation`` (the weights copied: the other
    peers keep theirs)."""
    import copy

    other = copy.deepcopy(model)
    other.set_attn_implementation(implementation)
    return other


def _takes_use_cache(model: torch.nn.Module) -> bool:
    import inspect

    return "use_cache" in inspect.signature(model.forward).parameters


def run_family(family: str, args, database: Path) -> dict:
    """One family: the fp32 eager reference, the peers built and warmed up, then stof-cc
    compiled, then every one timed in this process. The torch.compile peers compile first:
    on the lent machine their lazy imports, when they came after stof-cc's PyCUDA and nvcc
    work, failed with 'source code string cannot contain null bytes' in every run of a
    session, while the same imports in a process that had not run stof-cc read clean."""
    dtype = getattr(torch, args.dtype)
    model, make = build(family, args.layers, args.size)
    model = model.cuda()
    kwargs = make(args.batch, args.seq, "cuda")
    with torch.no_grad(), heads_repeated_sdpa():
        want = real_tokens(model(**kwargs), kwargs)
    half = model.to(dtype)
    kwargs = stof_cc.passes.cast_floating(kwargs, dtype)  # nn.TransformerEncoder's src; token ids stay
    row = {"family": family, "dtype": args.dtype, "batch": args.batch, "seq": args.seq, "peers": {}}
    with torch.no_grad():  # the dtype's own rounding: no implementation in it can be closer than eager's
        row["eager_err"] = relative_error(real_tokens(half(**kwargs), kwargs), want)
    tolerance = row["tolerance"] = max(TOLERANCE, 1.25 * row["eager_err"])
    makers = {"eager": lambda: half}
    if family in FLEX_PEERS:  # the model's own FlexAttention path (its mask a BlockMask, its kernel compiled)
        makers["flex_attention"] = lambda: _with_attention(half, "flex_attention")
    for mode in ("default", "reduce-overhead"):
        makers[f"compile_{mode}"] = lambda mode=mode: (torch._dynamo.reset(),
                                                       torch.compile(half, mode=mode, dynamic=False))[1]
    # the peers run without the KV cache, as stof_cc.compile's trace does: with it, a decoder's graph
    # also builds and returns the cache (found by review; it flattered the decoder rows)
    peer_kwargs = {**kwargs, "use_cache": False} if _takes_use_cache(half) else kwargs
    ready = {}
    with torch.no_grad():
        for label, make_peer in ({} if args.no_peers else makers).items():
            try:
                peer = make_peer()
                fn = lambda peer=peer: peer(**peer_kwargs)  # noqa: E731
                err = relative_error(real_tokens(fn(), kwargs), want)  # compiles the torch.compile peers
                row["peers"][label] = {"err": err, "ok": err < tolerance}
                ready[label] = fn
            except Exception as exc:  # a peer that fails is named, not dropped
                row["peers"][label] = {"ms": math.inf, "err": math.inf, "ok": False, "error": str(exc)[:300],
                                       "traceback": traceback.format_exc()[-3000:]}
                row["flaky_import"] = row.get("flaky_import", False) or "null bytes" in str(exc)
        started = time.perf_counter()
        try:
            compiled = stof_cc.compile(half, (), kwargs, dtype=dtype, tune=not args.no_tune, database=database)
            row["compile_s"] = time.perf_counter() - started
            run = lambda: compiled(**kwargs)  # noqa: E731
            row["stof_err"] = relative_error(real_tokens(run(), kwargs), want)
            row["stof_ms"] = bench(run)
            row["steps"] = compiled.explain()
            row["torch_steps"] = sum(s.kind == "torch" and "views only" not in s.note
                                     for v in compiled.variants.values() for s in v.steps)
            row["library_steps"] = sum(s.kind == "library" for v in compiled.variants.values() for s in v.steps)
            row["floor_ms"] = model_floor(compiled)
        except Exception as exc:  # reported, not hidden
            row.update(stof_err=math.inf, stof_ms=math.inf, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        print(f"  {family}: stof-cc {row['stof_ms']:.3f} ms, error {row['stof_err']:.1e}"
              + (f" ({row['error']})" if "error" in row else f", compile {row['compile_s']:.1f} s"), flush=True)
        if not args.no_backend:
            row.update(through_backend(half, kwargs, want, args, database))
        for label, fn in ready.items():
            row["peers"][label]["ms"] = bench(fn)
        for label, peer in row["peers"].items():
            print(f"  {family}: {label} {peer['ms']:.3f} ms, error {peer['err']:.1e}"
                  + (f" ({peer['error'][:200]})" if "error" in peer else ""), flush=True)
    correct = [p["ms"] for p in row["peers"].values() if p["ok"]]
    row["best_peer_ms"] = min(correct) if correct else math.inf
    row["speedup"] = row["best_peer_ms"] / row["stof_ms"] if row["stof_err"] < tolerance else 0.0
    return row


def through_backend(half, kwargs: dict, want: torch.Tensor, args, database: Path) -> dict:
    """The same model under ``torch.compile(backend=stof_cc.backend(...))`` (issue 21): its error,
    first-call time and median, and the warnings it gave (a graph on the fallback says why).
    Decoders get ``use_cache=False``, as `stof_cc.compile`'s trace switches the cache off: with it
    on, the graph dynamo hands over builds and returns the KV cache, as eager does."""
    import warnings

    if _takes_use_cache(half):
        kwargs = {**kwargs, "use_cache": False}
    out = {}
    started = time.perf_counter()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    # nn.TransformerEncoderLayer's fused inference op hides the layer from stof-cc (the backend
    # warns and says this): off, as a user following the warning would run it
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = torch.compile(half, dynamic=False,
                                     backend=stof_cc.backend(tune=not args.no_tune, database=database))
            run = lambda: compiled(**kwargs)  # noqa: E731
            out["backend_err"] = relative_error(real_tokens(run(), kwargs), want)
        out["backend_compile_s"] = time.perf_counter() - started
        out["backend_ms"] = bench(run)
        out["backend_warnings"] = sorted({str(w.message)[:300] for w in caught if "stof_cc backend" in str(w.message)})
    except Exception as exc:  # reported, not hidden
        out.update(backend_err=math.inf, backend_ms=math.inf, backend_error=f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    print(f"  backend: torch.compile(backend=stof_cc) {out['backend_ms']:.3f} ms, error {out['backend_err']:.1e}"
          + "".join(f"\n    {w}" for w in out.get("backend_warnings", []))
          + (f" ({out['backend_error']})" if "backend_error" in out else ""), flush=True)
    return out


def model_floor(compiled) -> float:
    """The floor of the compiled model's groups (benchmarks/floor.py: GEMMs in cuBLAS, attention
    at the dense kernels' speed times the mask's density, the rest at 3 TB/s); inf if it fails."""
    from floor import model_floor_ms  # benchmarks/, the script's folder

    try:
        return sum(model_floor_ms(v.graph, [s.group for s in v.steps], bench) for v in compiled.variants.values())
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        print(f"  floor not computed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return math.inf


def run_in_fresh_process(family: str, args, database: Path) -> dict:
    """One family in its own process (a failure cannot leak into the next family), run again
    once when its import of torch.compile's modules hit the lent machine's intermittent
    'source code string cannot contain null bytes' (a fresh process reads the files clean)."""
    argv = ["--dtype", args.dtype, "--size", args.size, "--batch", str(args.batch), "--seq", str(args.seq),
            "--layers", str(args.layers)]
    argv += [flag for flag, on in (("--no-tune", args.no_tune), ("--no-peers", args.no_peers),
                                   ("--no-backend", args.no_backend)) if on]
    for attempt in range(2):
        proc = subprocess.run([sys.executable, __file__, *argv, "--families", family, "--child", str(database)],
                              capture_output=True, text=True)
        print(proc.stderr[-2000:] if proc.returncode else "", end="", file=sys.stderr)
        lines = proc.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        if proc.returncode == 0 and lines:
            row = json.loads(lines[-1])
            if not row.get("flaky_import") or attempt == 1:
                return row
            print(f"  {family}: a peer hit the null-bytes import failure; running the family again", flush=True)
        elif attempt == 1 or "null bytes" not in proc.stderr:
            return {"family": family, "peers": {}, "stof_ms": math.inf, "stof_err": math.inf,
                    "best_peer_ms": math.inf, "speedup": 0.0, "error": proc.stderr[-300:]}
    raise AssertionError("unreachable")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with batch, sequence and layers defaulting to the size's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="bert,roberta,distilbert,gpt2,llama,llama_eager,mistral,qwen2,qwen3,olmo2,gemma3,"
                                                "phi3,bloom,falcon,cohere,"
                                                "vit,t5,encoder_layer,encoder_layer_nomask")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--size", choices=sorted(SIZES), default="base",
                        help="model dimensions and default batch / sequence / layers (the docstring says which)")
    parser.add_argument("--batch", type=int, help="default: the size's")
    parser.add_argument("--seq", type=int, help="default: the size's")
    parser.add_argument("--layers", type=int, help="default: the size's")
    parser.add_argument("--tiny", action="store_const", dest="size", const="tiny", help="--size tiny")
    parser.add_argument("--serving", action="store_const", dest="size", const="serving", help="--size serving")
    parser.add_argument("--no-tune", action="store_true", help="compile with tune=False (stage 1's picks)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--no-backend", action="store_true", help="skip the torch.compile(backend=stof_cc) column")
    parser.add_argument("--db", help="the tuning database (default: a fresh one in a temporary folder)")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the tuning database of a one-family run
    args = parser.parse_args(argv)
    defaults = dict(zip(("batch", "seq", "layers"), SIZES[args.size][1], strict=True))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main() -> None:
    args = parse_args()
    global SERVING
    SERVING = args.size == "serving"
    if args.child:
        print(json.dumps(run_family(args.families, args, Path(args.child))))
        return
    database = Path(args.db) if args.db else Path(tempfile.mkdtemp(prefix="stof-models-")) / "tuning.sqlite"
    rows = []
    for family in args.families.split(","):
        rows.append(run_in_fresh_process(family, args, database))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    names = sorted({n for r in rows for n in r["peers"]})
    print(f"\n{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"B={args.batch} S={args.seq} layers={args.layers}, size {args.size}"
          f"{' (every eighth sequence all padding)' if SERVING else ''}")
    print("| family | stof ms (error) | floor ms | torch steps | cuBLAS steps | backend=stof_cc ms (error) | "
          + "".join(f"{n} ms | " for n in names) + "speedup |")
    print("|" + "---|" * (len(names) + 7))
    for r in rows:
        cells = "".join((f"{r['peers'][n]['ms']:.3f}" + ("" if r["peers"][n]["ok"] else " (wrong)")
                         if n in r["peers"] else "-") + " | " for n in names)
        backend = f"{r.get('backend_ms', math.inf):.3f} ({r.get('backend_err', math.inf):.1e})"
        speedup = f"{r['speedup']:.2f}x" if math.isfinite(r["best_peer_ms"]) else "- (no peer)"
        print(f"| {r['family']} | {r['stof_ms']:.3f} ({r['stof_err']:.1e}) | {r.get('floor_ms', math.inf):.3f} | "
              f"{r.get('torch_steps', '-')} | "
              f"{r.get('library_steps', '-')} | {backend} | "
              f"{cells}{speedup} |")


if __name__ == "__main__":
    main()
