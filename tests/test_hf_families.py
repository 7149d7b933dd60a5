"""HuggingFace families built from tiny configs (random weights) trace with their default
config, no flags: the KV cache is switched off for the trace, the autocast-disabled region
of the rotary embeddings is inlined, and the graph equals eager; every attention is recognised."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

import stof_cc
from stof_cc.ir.frontend import TraceError
from stof_cc.passes import lower

transformers = pytest.importorskip("transformers")

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
         "vocab_size": 100}
DECODERS = {
    "gpt2": lambda size=SMALL: transformers.GPT2Model(transformers.GPT2Config(
        n_layer=2, n_embd=size["hidden_size"], n_head=4, vocab_size=100, n_positions=64, bos_token_id=0,
        eos_token_id=0)),
    "llama": lambda size=SMALL: transformers.LlamaModel(transformers.LlamaConfig(num_key_value_heads=2, **size)),
    "mistral": lambda size=SMALL: transformers.MistralModel(transformers.MistralConfig(
        num_key_value_heads=2, sliding_window=16, **size)),
    "qwen2": lambda size=SMALL: transformers.Qwen2Model(transformers.Qwen2Config(num_key_value_heads=2, **size)),
}


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoders_trace_with_their_default_config_and_match_eager(family):
    torch.manual_seed(0)
    model = DECODERS[family]().eval()
    assert model.config.use_cache  # the default: a cache would be returned
    ids = torch.randint(0, 100, (2, 24))
    padding = torch.ones(2, 24, dtype=torch.long)
    padding[1, 17:] = 0
    kwargs = {"input_ids": ids, "attention_mask": padding}
    graph, _ = lower(model, (), kwargs)
    assert model.config.use_cache  # restored after the trace
    attention = [n for n in graph.nodes() if n.op == "attention"]
    assert len(attention) == 2 and not any(n.op == "scaled_dot_product_attention" for n in graph.nodes())
    if family != "gpt2":  # RMSNorm as HF writes it: one rms_norm node per norm (2 a layer and the last)
        assert sum(n.op == "rms_norm" for n in graph.nodes()) == 5
    # the mask, built by HF from constants and attention_mask, is described: causal (Mistral: its
    # window, 0 <= q - k < sliding_window) and key padding, no mask tensor left
    window = {"mistral": 15}.get(family)
    for node in attention:
        assert node.args[3] is None and node.kwargs["is_causal"] and node.kwargs.get("window") == window
        # key padding is the model's own boolean test of attention_mask, computed every call
        assert nx.has_path(graph.nx_graph, "attention_mask", node.kwargs["key_padding"].name)
        # grouped-query: K and V are read with their own 2 heads, repeat_kv's copies are gone
        heads = [graph.node(node.args[i].name).spec.shape[1] for i in range(3)]
        assert heads == ([4, 4, 4] if family == "gpt2" else [4, 2, 2])
    assert not any(n.op == "expand" for n in graph.nodes())
    with torch.no_grad():
        want = model(**kwargs, use_cache=False).last_hidden_state
    got = stof_cc.interpret(graph, **kwargs).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_t5_encoder_position_buckets_are_functionalised_so_attention_is_recognised():
    """T5 computes its relative-position buckets with an in-place add_; once that is made
    out-of-place the passes run on the whole graph and both attentions are found."""
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(transformers.T5Config(num_layers=2, d_model=64, num_heads=4, d_kv=16,
                                                              d_ff=128, vocab_size=100)).eval()
    kwargs = {"input_ids": torch.randint(0, 100, (2, 24)), "attention_mask": torch.ones(2, 24, dtype=torch.long)}
    graph, _ = lower(model, (), kwargs)
    assert sum(n.op == "attention" for n in graph.nodes()) == 2
    with torch.no_grad():
        want = model(**kwargs).last_hidden_state
    torch.testing.assert_close(stof_cc.interpret(graph, **kwargs).last_hidden_state, want, rtol=1e-5, atol=1e-5)


class _Regions(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        with torch.autocast("cpu", enabled=False):
            z = y.float().sin()
            with torch.autocast("cpu", enabled=False):
                z = z.cos()
        return z + 1


class _EnabledAutocast(torch.nn.Module):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return x @ x


def test_scoping_regions_are_inlined_and_enabled_autocast_is_named():
    x = torch.randn(4, 4)
    graph = stof_cc.trace(_Regions(), (x,))
    assert all(n.op != "opaque" or "higher_order" not in str(n.target) for n in graph.nodes())
    torch.testing.assert_close(stof_cc.interpret(graph, x), _Regions()(x))
    with pytest.raises(TraceError, match="an enabled autocast region"):
        stof_cc.trace(_EnabledAutocast(), (x,))


ENCODERS = {
    "bert": lambda size=SMALL: transformers.BertModel(transformers.BertConfig(**size)),
    "roberta": lambda size=SMALL: transformers.RobertaModel(transformers.RobertaConfig(**size)),
    "distilbert": lambda size=SMALL: transformers.DistilBertModel(transformers.DistilBertConfig(
        n_layers=2, dim=size["hidden_size"], n_heads=4, hidden_dim=128, vocab_size=100)),
}
GPU_SIZE = {**SMALL, "hidden_size": 128}  # head dim 32: the smallest the attention kernels run


@pytest.mark.parametrize("family", sorted(ENCODERS))
@pytest.mark.parametrize("padded", [False, True])
def test_encoder_masks_become_key_padding_or_nothing(family, padded):
    """With attention_mask: key padding; without it, HF's all-true constant mask is no mask."""
    torch.manual_seed(0)
    model = ENCODERS[family]().eval()
    kwargs = {"input_ids": torch.randint(0, 100, (2, 24))}
    if padded:
        kwargs["attention_mask"] = torch.ones(2, 24, dtype=torch.long)
        kwargs["attention_mask"][1, 15:] = 0
    graph, _ = lower(model, (), kwargs)
    attention = [n for n in graph.nodes() if n.op == "attention"]
    assert len(attention) == 2
    for node in attention:
        assert node.args[3] is None and not node.kwargs.get("is_causal")
        assert (node.kwargs.get("key_padding") is not None) == padded
    with torch.no_grad():
        want = model(**kwargs).last_hidden_state
    torch.testing.assert_close(stof_cc.interpret(graph, **kwargs).last_hidden_state, want, rtol=1e-5, atol=1e-5)


def test_vit_has_no_mask():
    model = transformers.ViTModel(transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                         intermediate_size=128, image_size=32, patch_size=8)).eval()
    pixels = torch.randn(2, 3, 32, 32)
    graph, _ = lower(model, (pixels,))
    attention = [n for n in graph.nodes() if n.op == "attention"]
    assert len(attention) == 2 and all(n.args[3] is None and not n.kwargs.get("key_padding") for n in attention)


GPU_ONLY = {  # T5 at head dim 32: its relative position bias is added by the attention kernels
    "t5": lambda size: transformers.T5EncoderModel(transformers.T5Config(
        num_layers=2, d_model=size["hidden_size"], num_heads=4, d_kv=size["hidden_size"] // 4, d_ff=256,
        vocab_size=100)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(DECODERS) + sorted(ENCODERS) + sorted(GPU_ONLY))
def test_families_compile_on_the_gpu_and_match_eager(family):
    """Each family compiled for the GPU (fp16, CUDA graphs, key padding on the device) against
    its fp32 eager output on the real tokens; every attention runs stof-cc's kernel (T5's with
    its bias added), and the decoders' rotary embeddings the rotary kernel."""
    torch.manual_seed(0)
    model = {**DECODERS, **ENCODERS, **GPU_ONLY}[family](GPU_SIZE).eval().cuda()
    padding = torch.ones(2, 64, dtype=torch.long, device="cuda")
    padding[1, 40:] = 0
    kwargs = {"input_ids": torch.randint(0, 100, (2, 64), device="cuda"), "attention_mask": padding}
    with torch.no_grad():
        want = model(**kwargs).last_hidden_state[padding.bool()]
    compiled = stof_cc.compile(model, (), kwargs, tune=False)
    for _ in range(2):  # the second call replays the captured graph
        got = compiled(**kwargs).last_hidden_state[padding.bool()]
        assert torch.linalg.norm(got.float() - want) / torch.linalg.norm(want) < 1e-2
    (variant,) = compiled.variants.values()
    assert variant.graph_capture is not None
    steps = [s for s in variant.steps if s.group.kind == "attention"]
    assert len(steps) == 2 and all(s.kind == "attention" for s in steps)
    if family in ("llama", "mistral", "qwen2"):
        assert all(len(s.rotary) == 2 for s in steps)  # query and key


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(ENCODERS))
def test_fully_padded_sequences_get_what_the_model_gives_them_on_the_gpu(family):
    """A serving batch with sequences that are all padding: whatever the model's attention gives
    those rows on this GPU (recorded when the mask is described), the compiled model gives too;
    the whole output is compared, padded positions included."""
    torch.manual_seed(0)
    model = ENCODERS[family](GPU_SIZE).eval().cuda()
    padding = torch.ones(16, 64, dtype=torch.long, device="cuda")
    padding[::4] = 0
    padding[1::4, 40:] = 0
    kwargs = {"input_ids": torch.randint(0, 100, (16, 64), device="cuda"), "attention_mask": padding}
    with torch.no_grad():
        want = model(**kwargs).last_hidden_state
    compiled = stof_cc.compile(model, (), kwargs, tune=False)
    for _ in range(2):  # the second call replays the captured graph
        got = compiled(**kwargs).last_hidden_state
        assert torch.linalg.norm(got.float() - want) / torch.linalg.norm(want) < 1e-2
