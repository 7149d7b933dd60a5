"""GPT-OSS on attn_implementation="stof_cc": its attention sinks (transformers' ``s_aux``, one logit per
query head) in every path the attention function takes: the prefill kernels, the decode kernel,
transformers' SDPA where the kernels do not run (`_sdpa_with_sinks`: a zero key whose score is the
sink), and the custom op a compiled forward traces. Checked against attn_implementation="eager"
(transformers gives GPT-OSS no SDPA path) and the float32 reference, with sinks drawn large enough to
matter: dropped, they change every output."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

import stof_cc.hf  # noqa: E402
from stof_cc.ir.reference import masked_attention  # noqa: E402

# head dim 64: the decode kernel takes 64 and 128; a window of 8 so the decode steps pass it
CONFIG = T.GptOssConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, intermediate_size=256, vocab_size=100, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=8)


def _twins(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random-weight GPT-OSS causal LM on attn_implementation="stof_cc" and on "eager", same weights,
    its sinks drawn from N(0, 2) (the initialiser draws them near 0, where dropping them hides)."""
    stof_cc.hf.register()
    torch.manual_seed(0)
    ours = T.AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="stof_cc")
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    theirs = T.AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="eager")
    theirs.load_state_dict(ours.state_dict())
    return tuple(model.to(device, dtype).eval() for model in (ours, theirs))


def _prompt(device: str = "cpu", length: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by 5, as generation pads."""
    ids = torch.randint(1, 100, (2, length), generator=torch.Generator().manual_seed(1)).to(device)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :5] = 0
    return ids, attention_mask


def _inputs(heads: int, kv_heads: int, rows: int, keys: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    q = torch.randn(2, heads, rows, 64, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, keys, 64, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(heads) * 3


@pytest.mark.parametrize("case", ["causal", "one_query", "padding", "bias", "additive"])
def test_sdpa_with_sinks_is_the_reference(case):
    """The fallback's sinks: SDPA with one more key, zero, whose score the float mask sets to each head's
    sink, equals the float32 reference with sinks; without a mask a causal module attends top-left, as
    SDPA's is_causal; a row with every key masked gives 0 (only the sink), as the kernels give."""
    module = torch.nn.Module()
    module.is_causal = True
    rows, keys = (1, 10) if case == "one_query" else (10, 10)
    q, k, v, sinks = _inputs(4, 2, rows, keys)
    allowed, dense, bias = None, None, None
    if case == "causal":
        allowed = torch.ones(rows, keys, dtype=torch.bool).tril()
    if case in ("padding", "additive"):
        allowed = (torch.rand(2, 1, rows, keys) > 0.4) & torch.ones(rows, keys, dtype=torch.bool).tril()
        allowed[1, :, 3] = False  # a row with no key
        dense = allowed if case == "padding" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    if case == "bias":
        bias = torch.randn(1, 4, rows, keys)
        allowed = torch.ones(rows, keys, dtype=torch.bool).tril()
    got, _ = stof_cc.hf._sdpa_with_sinks(module, q, k, v, dense, 0.3, bias, sinks, {})
    want = masked_attention(q, k, v, allowed, 0.3, bias=bias, sinks=sinks)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    if case in ("padding", "additive"):
        assert not got[1, 3].any()


def test_sinks_of_the_wrong_count_are_named_in_the_fallback():
    q, k, v, sinks = _inputs(4, 2, 6, 6)
    with pytest.raises(ValueError, match="sinks must be a floating tensor of 4 logits"):
        stof_cc.hf._sdpa_with_sinks(torch.nn.Module(), q, k, v, None, 0.3, None, sinks[:3], {})


def test_the_ops_cpu_reference_counts_the_sinks():
    q, k, v, sinks = _inputs(4, 2, 12, 12)
    got = torch.ops.stof_cc.attention(q, k, v, "causal", 0.3, None, None, sinks)
    want = masked_attention(q, k, v, torch.ones(12, 12, dtype=torch.bool).tril(), 0.3, sinks=sinks)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="sinks must be a floating tensor of 4 logits"):
        torch.ops.stof_cc.attention(q, k, v, "causal", 0.3, None, None, sinks[:3])


def test_on_the_cpu_prefill_and_greedy_generate_are_eagers(monkeypatch):
    """On the CPU every call runs the fallback (SDPA with the sinks' key): the prompt's logits at real tokens
    are eager's, and greedy generate() gives eager's tokens."""
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    ours, theirs = _twins()
    ids, attention_mask = _prompt()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU runs SDPA, said once
        got, want = (m(input_ids=ids, attention_mask=attention_mask).logits for m in (ours, theirs))
        torch.testing.assert_close(got[attention_mask.bool()], want[attention_mask.bool()], rtol=1e-4, atol=1e-4)
        settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
        tokens = [m.generate(ids, attention_mask=attention_mask, **settings) for m in (ours, theirs)]
    assert torch.equal(*tokens)


def test_decode_steps_hand_the_sinks_to_the_decode_kernel(monkeypatch):
    """`DECODE_KERNEL` on, the kernel a CPU stand-in (tests/test_decode_attention.py's reference): every
    decode step of both layers reaches it with the sinks, the full layer's too (its steps over the whole
    cache go to SDPA's flash kernel without sinks, which SDPA has no form for), and the tokens are eager's."""
    from test_decode_attention import _reference

    calls = []

    def stand_in(q, k, v, mask, *, scale, q_position, k_position, key_padding, sinks=None):
        calls.append(sinks)
        return _reference(q, k, v, mask, scale, q_position, k_position, key_padding, sinks).to(q.dtype)

    monkeypatch.setattr(stof_cc.hf, "decode_unsupported", lambda q, k, mask: None)
    monkeypatch.setattr(stof_cc.hf, "decode_attention", stand_in)
    ours, theirs = _twins()
    ids, _ = _prompt()
    attention_mask = torch.ones_like(ids)  # no padding: the full layer's steps see their whole cache
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = [m.generate(ids, attention_mask=attention_mask, **settings) for m in (ours, theirs)]
    assert torch.equal(*tokens)
    assert len(calls) == 5 * CONFIG.num_hidden_layers and all(sinks is not None for sinks in calls)


def test_a_compiled_prefill_calls_the_op_with_the_sinks():
    """torch.compile of the forward: each layer's attention is one `torch.ops.stof_cc.attention` node that
    takes the layer's sinks, no graph break, and the output is eager's."""
    ours, theirs = _twins()
    ids, attention_mask = _prompt()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(ours.model, backend=keep, fullgraph=True)(input_ids=ids, attention_mask=attention_mask)
        want = theirs.model(input_ids=ids, attention_mask=attention_mask)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target in (torch.ops.stof_cc.attention, torch.ops.stof_cc.attention.default)]
    assert len(calls) == CONFIG.num_hidden_layers and all(n.args[7] is not None for n in calls)
    real = attention_mask.bool()
    torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_compiled_generate_with_a_static_cache_keeps_the_sinks(device, monkeypatch):
    """generate() with a static cache compiles the decode steps' forward (on the CPU forced, in float32; on
    CUDA in bf16, as transformers picks it: reduce-overhead, CUDA graphs): their attention is SDPA with the
    sinks' key inside the graph; every step's logits are eager's (on CUDA within 2e-2 while the tokens agree:
    random weights leave near-ties)."""
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    torch._dynamo.reset()
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static",
                "output_logits": True, "return_dict_in_generate": True}
    if device == "cpu":
        compile_config = T.CompileConfig(mode="default")
        compile_config._compile_all_devices = True
        settings["compile_config"] = compile_config
    ours, theirs = _twins(device, torch.float32 if device == "cpu" else torch.bfloat16)
    ids, attention_mask = _prompt(device, length=12)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = (m.generate(ids, attention_mask=attention_mask, **settings) for m in (ours, theirs))
    assert any("in the compiled graph" in str(w.message) for w in caught), [str(w.message) for w in caught]
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        error = float((a.float() - b.float()).norm() / b.float().norm())
        assert error < (1e-5 if device == "cpu" else 2e-2), (step, error)
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            break


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_the_gpu_prefill_and_decode_run_the_kernels_with_eagers_logits(dtype, monkeypatch):
    """The prefill in stof-cc's attention kernels and six decode steps in its decode kernel (no call in
    SDPA: any fallback warns, and fails the test), fed eager's greedy tokens, past the window: each step's
    logits within 2e-2 of eager's in the same dtype (the experts' routing takes near-ties either way)."""
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    ours, theirs = _twins("cuda", dtype)
    from test_hf_attention import assert_steps_match

    tokens, attention_mask = _prompt("cuda", 40)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="attn_implementation='stof_cc'")
        assert_steps_match(ours, theirs, tokens, attention_mask, 2e-2)
