"""`torch.compile` of a transformers model with ``attn_implementation="stof_cc"`` (issue 36, item 3):
one graph, no graph break (``fullgraph=True``), each layer's attention a `torch.ops.stof_cc.attention`
node with its mask as a spec where stof-cc describes the mask while dynamo traces, else transformers'
SDPA inside the graph; the compiled model gives sdpa's output. On the CPU (the op's torch reference)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

T = pytest.importorskip("transformers")

import stof_cc.hf  # noqa: E402  (registers "stof_cc")

SEQ = 32
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 100}


def _models(config):
    """(the model on stof_cc, the same weights on sdpa), fp32, eval."""
    torch.manual_seed(0)
    ours = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="stof_cc").eval()
    sdpa = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(ours.state_dict())
    return ours, sdpa


def _compiled(model):
    """The model under torch.compile with fullgraph=True (a graph break raises), and the attention
    nodes of its graphs: ("op", spec) or ("sdpa", None)."""
    found = []

    def backend(graph_module, _inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and "stof_cc.attention" in str(node.target):
                found.append(("op", node.args[3]))
            elif node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                found.append(("sdpa", None))
        return graph_module.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True), found


CONFIGS = {"llama": lambda: T.LlamaConfig(**SMALL), "qwen3": lambda: T.Qwen3Config(head_dim=16, **SMALL),
           "mistral": lambda: T.MistralConfig(sliding_window=8, **SMALL),
           "gemma3": lambda: T.Gemma3TextConfig(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                                head_dim=16, **SMALL)}
# and decoders no issue names: the same mask functions, so the same path
CONFIGS |= {"olmo2": lambda: T.Olmo2Config(**SMALL), "phi3": lambda: T.Phi3Config(pad_token_id=0, **SMALL),
            "starcoder2": lambda: T.Starcoder2Config(sliding_window=8, **SMALL),
            "gpt_neox": lambda: T.GPTNeoXConfig(**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"})}
SPECS = {"llama": ["causal"] * 2, "qwen3": ["causal"] * 2, "mistral": ["sliding:w=7,causal=1"] * 2,
         "gemma3": ["sliding:w=7,causal=1", "causal"], "olmo2": ["causal"] * 2, "phi3": ["causal"] * 2,
         "starcoder2": ["sliding:w=7,causal=1"] * 2, "gpt_neox": ["causal"] * 2}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_compiled_model_is_one_graph_of_stof_cc_ops_and_matches_sdpa(family, padded):
    ours, sdpa = _models(CONFIGS[family]())
    ids = torch.randint(0, 100, (2, SEQ))
    kwargs = {"input_ids": ids, "use_cache": True}
    if padded:  # left padding: the 2-D mask reaches the op as key padding
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, :5] = 0
        kwargs["attention_mask"] = mask
    compiled, found = _compiled(ours)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = compiled(**kwargs).logits
        want = sdpa(**kwargs).logits
    assert found == [("op", spec) for spec in SPECS[family]]
    rows = slice(None) if not padded else (1, slice(5, None))  # padded queries: 0 here, sdpa attends every key
    torch.testing.assert_close(got[rows] if padded else got, want[rows] if padded else want, atol=1e-4, rtol=1e-4)


def test_a_mask_described_only_outside_a_graph_runs_sdpa_inside_it():
    """With no cache and no 2-D mask, transformers wraps the causal mask in its packing functions while
    tracing (their closures hold tensors dynamo cannot read): SDPA with transformers' own mask, in the
    graph, with one warning given at trace time."""
    ours, sdpa = _models(CONFIGS["llama"]())
    ids = torch.randint(0, 100, (1, SEQ))
    stof_cc.hf._WARNED.clear()
    compiled, found = _compiled(ours)
    with torch.no_grad(), pytest.warns(UserWarning, match="sdpa runs this attention in the compiled graph"):
        got = compiled(input_ids=ids, use_cache=False).logits
    with torch.no_grad():
        want = sdpa(input_ids=ids, use_cache=False).logits
    assert found == [("sdpa", None)] * 2
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_an_encoder_is_one_graph_of_ops_with_its_padding():
    torch.manual_seed(0)
    config = T.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                          vocab_size=100)
    ours = T.AutoModel.from_config(copy.deepcopy(config), attn_implementation="stof_cc").eval()
    sdpa = T.AutoModel.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(ours.state_dict())
    ids, mask = torch.randint(0, 100, (2, SEQ)), torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -7:] = 0
    compiled, found = _compiled(ours)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
        want = sdpa(input_ids=ids, attention_mask=mask).last_hidden_state
    assert found == [("op", None)] * 2
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, :-7], want[1, :-7], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_on_the_gpu_the_compiled_model_runs_the_kernels_and_matches_sdpa(family, monkeypatch):
    """Inductor's graph calls the op, whose CUDA implementation runs stof-cc's kernels (d = 64, fp16)."""
    import stof_cc.runtime.attention_op as attention_op

    calls = []
    kernels = attention_op.attention
    monkeypatch.setattr(attention_op, "attention", lambda *a, **k: calls.append(1) or kernels(*a, **k))
    sizes = SMALL | {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    config = {"llama": T.LlamaConfig, "mistral": lambda **kw: T.MistralConfig(sliding_window=8, **kw),
              "gemma3": lambda **kw: T.Gemma3TextConfig(sliding_window=8, layer_types=["sliding_attention",
                                                                                      "full_attention"], **kw)}[family]
    ours, sdpa = _models(config(**sizes))
    ours, sdpa = ours.half().cuda(), sdpa.half().cuda()
    ids = torch.randint(0, 100, (2, 256), device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=ids, use_cache=True).logits.float()
        want = sdpa(input_ids=ids, use_cache=True).logits.float()
    assert len(calls) >= 2  # each layer's attention, through the op
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def _packed_inputs():
    """One row of two documents (6 and 10 tokens), as transformers' DataCollatorWithFlattening gives it."""
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None]
    return {"input_ids": torch.randint(0, 100, (1, 16)), "position_ids": positions, "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu, "max_length_q": 10, "max_length_k": 10, "use_cache": True}


@pytest.mark.parametrize("grad", [False, True])
def test_packed_sequences_stay_apart_in_the_graph_on_the_op_and_on_sdpa(grad):
    """cu_seq_lens reach the op (no_grad) or, where SDPA runs (autograd on), SDPA's mask."""
    ours, _ = _models(CONFIGS["llama"]())
    inputs = _packed_inputs()
    with torch.no_grad():
        alone = ours(input_ids=inputs["input_ids"][:, 6:], use_cache=False).logits
    compiled, found = _compiled(ours)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = compiled(**inputs).logits.detach()
    assert found == ([("sdpa", None)] * 2 if grad else [("op", "causal")] * 2)
    torch.testing.assert_close(got[0, 6:], alone[0], atol=1e-4, rtol=1e-4)


def test_packing_a_cross_attention_is_refused_while_tracing():
    config = T.BartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
    model = T.BartForConditionalGeneration._from_config(config, attn_implementation="stof_cc").eval()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    compiled, _ = _compiled(model.get_decoder())
    with torch.no_grad(), pytest.raises(Exception, match="packs one row of a self-attention"):
        compiled(input_ids=torch.randint(3, 100, (1, 8)), encoder_hidden_states=torch.randn(1, 10, 32),
                 use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)


def test_a_mask_tensor_the_caller_built_runs_sdpa_in_the_graph():
    ours, sdpa = _models(CONFIGS["llama"]())
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.tril(torch.ones(12, 12, dtype=torch.bool))[None, None].expand(2, 1, 12, 12).clone()
    mask[1, :, :, :3] = False
    mask[1, :, :3, :3] = torch.eye(3, dtype=torch.bool)
    compiled, found = _compiled(ours)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want = sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert found == [("sdpa", None)] * 2
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_layer_run_eagerly_inside_a_compiled_model_takes_the_traced_mask():
    ours, sdpa = _models(CONFIGS["llama"]())
    ids = torch.randint(0, 100, (2, 12))
    layer = ours.model.layers[1].self_attn
    layer.forward = torch.compiler.disable(layer.forward)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(ours, backend="eager")(input_ids=ids, use_cache=True).logits
        want = sdpa(input_ids=ids, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_ops_fake_kernel_gives_the_values_head_dim():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 8)
    out = torch.compile(lambda *t: torch.ops.stof_cc.attention(*t, "causal", None, None), fullgraph=True)(q, k, v)
    assert out.shape == (1, 2, 8, 8)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_position_ids_without_a_mask_are_said_to_follow_the_model_without_its_cache(family):
    """Without a cache, transformers reads position_ids that restart as packed sequences; with its cache on (the
    default) it does not. The trace switches the cache off, so the compiled model attends within each
    sequence where eager attended across them, silently (found by review): it is said."""
    import transformers as T

    torch.manual_seed(0)
    shapes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100}
    model = (T.LlamaModel(T.LlamaConfig(**shapes)) if family == "llama" else T.Qwen2Model(T.Qwen2Config(**shapes))).eval()
    ids = torch.randint(1, 100, (1, 12))
    packed = {"input_ids": ids, "position_ids": torch.cat([torch.arange(5), torch.arange(7)])[None]}
    with pytest.warns(UserWarning, match="follows the model called with use_cache=False"):
        compiled = stof_cc.compile(model, (), packed, dtype=torch.float32, tune=False)
    with torch.no_grad():
        want = model(**packed, use_cache=False).last_hidden_state
    torch.testing.assert_close(compiled(**packed).last_hidden_state, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # positions that do not restart: no warning
        stof_cc.trace(model, (), {"input_ids": ids, "position_ids": torch.arange(12)[None]})
