"""HuggingFace generation with attn_implementation="stof_cc" beside "sdpa" and "flex_attention"
(issue 36's bar); GPT-OSS, which transformers gives no SDPA path (its attention sinks), beside "eager".

    python benchmarks/hf_generate.py [--families llama,qwen2,mistral,gemma3] [--hidden 2048] [--layers 4]
                                     [--prompt 4096] [--new 128] [--batch 1,8] [--dtype bfloat16] [--rounds 5] [--sdpa-decode]
                                     [--json out.json]

Per family and batch: one random-weight model (``--hidden``, head dim 128, a quarter as many K/V
heads, FFN 4 x hidden, ``--layers``), its weights loaded into each implementation's copy; a prompt
of ``--prompt`` random tokens (with B > 1 the second half of the batch left-padded by a quarter, as
generation pads); the prefill (one forward, no cache) timed with `triton.testing.do_bench`, then
greedy `generate()` of ``--new`` tokens timed end to end (the median of ``--rounds`` after one
warm-up; stof-cc and sdpa, the bar's pair, take turns round by round, in either order as often, as
the host's speed drifts within a run; Flex's generate() runs once, for its tokens). Every
implementation's tokens are compared with sdpa's (the baseline; GPT-OSS's is eager): the bar asks for identical
greedy tokens, and random weights make near-ties, so the row reports the first position where they differ, and each
implementation's error against the same model in float32 (the baseline's implementation; the prompt's last
logits, relative): where tokens differ, it says which side is nearer the exact answer. stof-cc's
decode steps run in its decode kernel (`stof_cc.hf.DECODE_KERNEL`) where a step's mask hides keys (B = 8:
the left padding); a step that sees every key of its cache (B = 1) runs SDPA's flash kernel, which is faster
there (stof_cc/hf.py, docs/decisions.md#decode-kernel). With ``--sdpa-decode`` every step runs in
transformers' SDPA (as before the kernel; stof_cc/hf.py says so once).
Needs an NVIDIA GPU, PyCUDA, nvcc and transformers.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stof_cc.hf  # noqa: E402

IMPLEMENTATIONS = ("stof_cc", "sdpa", "flex_attention")
VOCAB = 32000
NO_SDPA = ("gpt_oss",)  # transformers has no SDPA path for them: eager is the baseline


def baseline_of(family: str) -> str:
    """The implementation stof-cc is held against (and whose tokens the others are compared with)."""
    return "eager" if family in NO_SDPA else "sdpa"


def implementations_of(family: str) -> tuple[str, ...]:
    """stof_cc, the family's baseline and flex_attention (the baseline and stof_cc: the timed pair; Flex's
    generate() gives its tokens but is not timed)."""
    return tuple(baseline_of(family) if name == "sdpa" else name for name in IMPLEMENTATIONS)


def config_of(family: str, hidden: int, layers: int):
    """The family's config at ``hidden`` (head dim 128, K/V heads a quarter of the query heads; GPT-OSS
    as it ships: head dim 64, a 128-token window every other layer, experts as wide as the model, two of
    eight per token)."""
    import transformers as T

    head_dim = 64 if family == "gpt_oss" else 128
    heads = hidden // head_dim
    common = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": max(1, heads // 4), "intermediate_size": 4 * hidden, "vocab_size": VOCAB,
              "max_position_embeddings": 32768, "pad_token_id": 0, "eos_token_id": None, "bos_token_id": None}
    configs = {
        "llama": lambda: T.LlamaConfig(**common),
        "qwen2": lambda: T.Qwen2Config(**common),
        "mistral": lambda: T.MistralConfig(sliding_window=2048, **common),
        "gemma3": lambda: T.Gemma3TextConfig(head_dim=128, sliding_window=1024, **common),
        "gpt_oss": lambda: T.GptOssConfig(**(common | {"intermediate_size": hidden}), head_dim=64, sliding_window=128,
                                          num_local_experts=8, num_experts_per_tok=2),
    }
    return configs[family]()


def prompt_of(batch: int, length: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their attention mask (left padding in the second half of the batch)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[batch // 2:, : length // 4] = 0
    ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


def models_of(config, implementations, dtype: torch.dtype, device: str) -> dict:
    """One model per implementation, all with the first one's random weights."""
    import transformers as T

    torch.manual_seed(0)
    models = {}
    for name in implementations:
        model = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
        models[name] = model.to(device=device, dtype=dtype).eval()
    first = next(iter(models.values()))
    for model in models.values():
        model.load_state_dict(first.state_dict())
    return models


def logits_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """The relative error (Frobenius) of the prompt's last logits against the float32 model's."""
    return float((got.float() - reference).norm() / reference.norm())


def first_difference(tokens: torch.Tensor, reference: torch.Tensor) -> int | None:
    """The first generated position where ``tokens`` and ``reference`` differ (None: identical)."""
    differs = (tokens != reference).any(0).nonzero()
    return None if differs.numel() == 0 else int(differs[0])


def prefill_ms(forward, device: str) -> float:
    """Median ms of ``forward()``: triton's do_bench on the GPU, the host clock elsewhere (the
    CPU run is the script's own test)."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(forward, warmup=5, rep=50, return_mode="median"))
    started = time.perf_counter()
    forward()
    return (time.perf_counter() - started) * 1e3


def run(family: str, batch: int, args, implementations=None, device: str = "cuda") -> dict:
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    baseline = baseline_of(family)
    implementations = implementations_of(family) if implementations is None else implementations
    models = models_of(config_of(family, args.hidden, args.layers), implementations, dtype, device)
    ids, mask = prompt_of(batch, args.prompt, device)
    row = {"family": family, "batch": batch, "baseline": baseline, "prefill_ms": {}, "generate_s": {},
           "first_difference": {}, "logits_error": {}}
    tokens = {}
    settings = {"max_new_tokens": args.new, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        exact = models_of(config_of(family, args.hidden, args.layers), (baseline,), torch.float32, device)[baseline]
        exact.load_state_dict(next(iter(models.values())).state_dict())  # the same (rounded) weights, in float32
        last = lambda model: model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1).logits[:, -1]  # noqa: E731
        reference = last(exact).float()
        del exact
        for name, model in models.items():
            try:
                row["logits_error"][name] = logits_error(last(model), reference)
                row["prefill_ms"][name] = prefill_ms(
                    lambda model=model: model(input_ids=ids, attention_mask=mask, use_cache=False), device)
                tokens[name] = model.generate(ids, attention_mask=mask, **settings)[:, ids.shape[1]:]  # warm-up
            except Exception as exc:  # reported, not hidden
                row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        # generate() is bound by the host, whose speed drifts by 20-30% within a run: the implementations
        # take turns, round by round, so each round compares them under the same conditions
        times: dict[str, list[float]] = {name: [] for name in models
                                         if name in ("stof_cc", baseline) and name not in row.get("errors", {})}
        for round_ in range(args.rounds):
            for name in list(times)[::-1 if round_ % 2 else 1]:  # either order as often: no order bias
                try:
                    sync()
                    started = time.perf_counter()
                    tokens[name] = models[name].generate(ids, attention_mask=mask, **settings)[:, ids.shape[1]:]
                    sync()
                    times[name].append(time.perf_counter() - started)
                except Exception as exc:  # reported, not hidden
                    row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    del times[name]
        row["generate_s"] = {name: statistics.median(t) for name, t in times.items()}
    if baseline in tokens:
        row["first_difference"] = {name: first_difference(t, tokens[baseline]) for name, t in tokens.items()}
    return row


def table(rows: list[dict]) -> str:
    """The rows as a markdown table; "sdpa" is each row's baseline (eager where the family has no SDPA: the
    row says so)."""
    lines = ["| family | B | prefill ms stof_cc / sdpa / flex | prefill vs sdpa | vs flex | generate s stof_cc / sdpa "
             "| generate vs sdpa | tokens differ from sdpa at | logits error vs fp32 stof_cc / sdpa / flex |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        baseline = r.get("baseline", "sdpa")
        p, g, e = ({("sdpa" if k == baseline else k): v for k, v in r.get(part, {}).items()}
                   for part in ("prefill_ms", "generate_s", "logits_error"))
        ratio = lambda d, a, b: f"{d[b] / d[a]:.2f}x" if a in d and b in d else "-"  # noqa: E731
        cell = lambda d, k, f: f.format(d[k]) if k in d else "-"  # noqa: E731
        differ = r["first_difference"].get("stof_cc", "-")
        family = r["family"] + ("" if baseline == "sdpa" else f" (vs {baseline}: no sdpa)")
        lines.append(f"| {family} | {r['batch']} | {cell(p, 'stof_cc', '{:.2f}')} / {cell(p, 'sdpa', '{:.2f}')} / "
                     f"{cell(p, 'flex_attention', '{:.2f}')} | {ratio(p, 'stof_cc', 'sdpa')} | "
                     f"{ratio(p, 'stof_cc', 'flex_attention')} | {cell(g, 'stof_cc', '{:.2f}')} / "
                     f"{cell(g, 'sdpa', '{:.2f}')} | {ratio(g, 'stof_cc', 'sdpa')} | "
                     f"{'identical' if differ is None else differ} | "
                     f"{' / '.join(cell(e, k, '{:.1e}') for k in ('stof_cc', 'sdpa', 'flex_attention'))} |" + "".join(f" {k}: {v}" for k, v in
                                                                                 r.get("errors", {}).items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,qwen2,mistral,gemma3")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=5, help="timed generate() calls per implementation, taken in turn")
    parser.add_argument("--sdpa-decode", action="store_true", help="stof-cc's decode steps in SDPA, not its decode kernel")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    stof_cc.hf.register()
    stof_cc.hf.DECODE_KERNEL = not args.sdpa_decode
    rows = []
    for family in args.families.split(","):
        for batch in map(int, args.batch.split(",")):
            rows.append(run(family, batch, args))
            print(rows[-1], flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\n{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"hidden {args.hidden}, {args.layers} layers, prompt {args.prompt}, {args.new} new tokens, "
          f"decode steps in {'SDPA' if args.sdpa_decode else 'the decode kernel where keys are hidden, else SDPA'}")
    print(table(rows))


if __name__ == "__main__":
    main()
