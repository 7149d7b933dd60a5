"""describe_key_padding: BERT's attention_mask becomes key_padding; other masks stay, with reasons."""

from __future__ import annotations

import math

import networkx as nx
import pytest
import torch

from stof_cc import masks
from stof_cc.ir.frontend import trace
from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec, assert_structural_equal
from stof_cc.ir.interpret import interpret
from stof_cc.loading import load_factory
from stof_cc.passes import (
    PassReports,
    canonicalize,
    describe_key_padding,
    recognise_attention,
    run_passes,
)
from stof_cc.passes import key_padding as key_padding_module
from stof_cc.passes.key_padding import KeyPaddingReport


def test_bert_attention_mask_becomes_key_padding(example_path):
    module, args, kwargs = load_factory(example_path("tiny_bert"))
    original = trace(module, args, kwargs)
    reports = PassReports()
    graph = run_passes(original, reports)
    report = reports.padding
    assert len(report.rewritten) == 2 and len(set(report.rewritten.values())) == 1
    attention = [n for n in graph.nodes() if n.op == "attention"]
    # key_padding reads the model's own test of attention_mask (a boolean per key), computed every call
    assert all(n.args[3] is None and nx.has_path(graph.nx_graph, "attention_mask", n.kwargs["key_padding"].name)
               and graph.node(n.kwargs["key_padding"].name).spec.shape == (2, 32) for n in attention)
    assert len(graph) < len(recognise_attention(canonicalize(original)))  # the [B, 1, S, S] mask is gone
    want, got = interpret(original, *args, **kwargs), interpret(graph, *args, **kwargs)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-5, atol=1e-5)


def test_bert_padding_keeps_the_models_meaning_for_any_mask_values_and_fully_padded_rows(example_path):
    """HF's eager BERT adds finfo.min at padded keys: a sequence that is all padding attends
    every key uniformly there (the mean of V), and attention_mask's values other than 0 and 1
    mean what the model's own ``.bool()`` says. The described graph gives the same."""
    module, args, kwargs = load_factory(example_path("tiny_bert"))
    graph = run_passes(trace(module, args, kwargs))
    (node, *_) = [n for n in graph.nodes() if n.op == "attention"]
    assert node.kwargs.get("empty_rows") == "mean"
    for values in ([[1] * 32, [0] * 32], [[2] * 16 + [-1] * 16, [1] * 8 + [0] * 24]):
        mask = torch.tensor(values)
        with torch.no_grad():
            want = module(*args, attention_mask=mask).last_hidden_state
        got = interpret(graph, *args, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class MaskedAttention(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, q, k, v, padding):
        position_bias = torch.arange(q.shape[-2]).float()[None, None, None, :] * 0.5
        if self.how == "padding":
            mask = padding[:, None, None, :].bool()
        elif self.how == "bias":  # ALiBi-like: a bias, not a mask
            mask = (1.0 - padding[:, None, None, :].float()) * -1e9 + position_bias
        elif self.how == "boolean bias":  # T5's: the bias where attended, finfo.min elsewhere
            mask = torch.where(padding[:, None, None, :].bool(), position_bias, torch.finfo(torch.float32).min)
        else:  # depends on the query too: not key padding
            mask = padding[:, None, :, None].bool() & padding[:, None, None, :].bool()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _run(how: str):
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    padding = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    reports = PassReports()
    original = trace(MaskedAttention(how), (q, k, v, padding))
    graph = run_passes(original, reports)
    return reports.padding, original, graph, (q, k, v, padding)


def test_boolean_padding_mask_is_recognised_and_equal():
    report, original, graph, args = _run("padding")
    assert report.rewritten
    torch.testing.assert_close(interpret(graph, *args), interpret(original, *args), rtol=1e-5, atol=1e-5)


def test_a_bias_from_integer_padding_stays_the_models_tensor():
    """ALiBi-like: a position bias plus (1 - padding) * -1e9, the padding an integer input.
    At padding = 2 that adds +1e9: no key-padding description is exact for every value, so the
    node keeps the model's mask tensor (a bias the kernels add) and gives eager's answer."""
    report, original, graph, args = _run("bias")
    assert not report.rewritten and "one boolean per [batch, key]" in next(iter(report.refused.values()))
    q, k, v, _ = args
    for padding in (torch.tensor([[1] * 8, [1] * 5 + [0] * 3]), torch.tensor([[2] * 8, [1] * 7 + [0]])):
        torch.testing.assert_close(interpret(graph, q, k, v, padding), interpret(original, q, k, v, padding),
                                   rtol=1e-5, atol=1e-5)


def test_a_bias_with_boolean_padding_becomes_key_padding_and_the_bias_alone():
    """T5's form: a position bias where attended, finfo.min at padded keys, from a boolean per
    key. The node keeps the bias (one constant, batch dim cut to 1) and reads the padding as
    key padding; same values."""
    report, original, graph, args = _run("boolean bias")
    (node,) = [n for n in graph.nodes() if n.op == "attention"]
    assert report.rewritten and "a bias [1, 1, 8, 8]" in report.structure[node.name]
    assert graph.constants[node.args[3].name].shape == (1, 1, 8, 8)
    torch.testing.assert_close(interpret(graph, *args), interpret(original, *args), rtol=1e-5, atol=1e-5)


class ModelsOwnTest(torch.nn.Module):
    """Padding tests that agree on 0 and 1 and differ elsewhere, and attention forms that give a
    query with no key 0 (SDPA's boolean mask here), the mean of V (a finite additive mask), NaN
    (the chain's masked_fill with -inf) or the attention with no mask (a finite fill that only
    shifts a row's scores)."""

    def __init__(self, test: str, form: str) -> None:
        super().__init__()
        self.test, self.form = test, form

    def forward(self, q, k, v, padding):
        keep = {"== 1": padding == 1, "> 0": padding > 0, "!= 0": padding != 0}[self.test][:, None, None, :]
        if self.form == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        if self.form == "shifting":  # T5 in fp16: a fill that shifts the scores alike, SDPA in fp32 inside
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, 0.0, -65504.0))
        scores = q @ k.transpose(-2, -1) / 4.0
        if self.form == "additive":
            scores = scores + torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        else:
            scores = scores.masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("form", ["sdpa", "additive", "masked_fill", "shifting"])
@pytest.mark.parametrize("test", ["== 1", "> 0", "!= 0"])
def test_key_padding_is_the_models_own_test_for_every_value(test, form):
    q, k, v = (torch.randn(3, 2, 8, 16) for _ in range(3))
    module = ModelsOwnTest(test, form)
    reports = PassReports()
    graph = run_passes(trace(module, (q, k, v, torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 8]))), reports)
    (node,) = [n for n in graph.nodes() if n.op == "attention"]
    assert node.args[3] is None and node.kwargs["key_padding"] is not None, reports.padding
    assert node.kwargs.get("empty_rows", "zero") == {"sdpa": "zero", "additive": "mean", "masked_fill": "nan",
                                                     "shifting": "unmasked"}[form]
    for padding in ([[2, 2, 1, 1, -1, 0, 0, 3], [1] * 5 + [0] * 3, [0] * 8], [[-1] * 8, [2] * 8, [5, 0] * 4]):
        padding = torch.tensor(padding)
        tolerance = 1e-2 if form == "shifting" else 1e-5  # the model's shifted scores keep 2^-8 of 65504
        torch.testing.assert_close(interpret(graph, q, k, v, padding), module(q, k, v, padding),
                                   rtol=tolerance, atol=tolerance, equal_nan=True)


class PaddingDependentBias(torch.nn.Module):
    def forward(self, q, k, v, padding):
        mask = (1.0 - padding[:, None, None, :].float()) * -1e9 + padding.sum(-1)[:, None, None, None].float()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_query_dependent_masks_and_padding_dependent_biases_stay_tensors():
    report, *_ = _run("query")
    assert not report.rewritten and "one boolean per [batch, key]" in next(iter(report.refused.values()))
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    reports = PassReports()
    run_passes(trace(PaddingDependentBias(), (q, k, v, torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))), reports)
    assert not reports.padding.rewritten
    assert "one boolean per [batch, key]" in next(iter(reports.padding.refused.values()))


def test_from_padding_uses_lengths_for_right_padding():
    right = masks.from_padding(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), seq_q=4)
    assert "key_padding" in repr(right)
    holes = masks.from_padding(torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), seq_q=4)
    dense = holes.to_dense(4, 4, batch=2, heads=1)
    assert dense[0, 0, :, 1].logical_not().all() and dense[0, 0, :, 2].all() and dense[1].all()
    # any number of queries, as right padding: the mask says which keys are real, not how many queries there are
    for padding in ([[1, 1, 0], [1, 1, 1]], [[0, 1, 1], [1, 1, 1]]):
        keep = torch.tensor(padding).bool()
        for seq_q in (1, 2, 5):
            got = masks.from_padding(torch.tensor(padding)).to_dense(seq_q, 3, batch=2, heads=1)
            assert torch.equal(got, keep[:, None, None, :].expand(2, 1, seq_q, 3)), (padding, seq_q)


@pytest.mark.gpu
def test_from_padding_with_gaps_runs_on_a_gpu():
    """Its table stays on the CPU; on a machine with a GPU it was evaluated there, indexing the CPU table
    with GPU positions (a review's reading: `to_dense` and the block masks raised)."""
    from stof_cc import attention
    from stof_cc.ir.reference import masked_attention

    padding = torch.ones(2, 300, dtype=torch.long)
    padding[0, :40] = 0
    padding[1, 100:120] = 0
    description = masks.from_padding(padding.cuda())
    dense = description.to_dense(300, 300, batch=2, heads=1)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    want = masked_attention(q, k, v, dense.cuda())
    assert (attention(q, k, v, description) - want).abs().max() < 1e-2


def test_from_padding_fits_its_own_batch_and_keys_in_either_form():
    """Right padding became `key_padding` with its lengths and forgot how many keys the padding
    covered: seq_k = 5 hid keys 3 and 4 of a 3-key padding with no error, and one row applied to no
    other batch there while padding with holes applied it to every batch (found by review). Both
    forms now refuse another seq_k or batch, naming from_padding; a meta or empty padding is refused."""
    for padding in ([[1, 1, 1]], [[1, 0, 1]]):
        description = masks.from_padding(torch.tensor(padding))
        assert torch.equal(description.to_dense(2, 3)[0, 0], torch.tensor(padding).bool().expand(2, 3))
        with pytest.raises(masks.MaskError, match="from_padding: the padding covers 3 keys, but seq_k=5"):
            description.to_dense(2, 5)
        with pytest.raises(masks.MaskError, match="from_padding: .*batch=3"):
            description.to_dense(2, 3, batch=3)
    with pytest.raises(masks.MaskError, match="from_padding: padding is on the meta device"):
        masks.from_padding(torch.ones(2, 3, device="meta"))
    for empty in (torch.ones(0, 3), torch.ones(2, 0)):
        with pytest.raises(masks.MaskTypeError, match="from_padding: padding must be a .batch, keys. tensor with a row"):
            masks.from_padding(empty)


# -- before / expected ---------------------------------------------------------------------

_QKV = TensorSpec((2, 2, 8, 16), torch.float32)


def _recognised(module: torch.nn.Module) -> Graph:
    """``module``'s graph as describe_key_padding receives it (after recognise_attention)."""
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    padding = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    return recognise_attention(canonicalize(trace(module, (q, k, v, padding))))


class _CausalPadded(torch.nn.Module):
    """A decoder's mask: the causal triangle and-ed with the key padding."""

    def forward(self, q, k, v, padding):
        causal = torch.ones(8, 8, dtype=torch.bool).tril()
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=padding[:, None, None, :].bool() & causal)


@pytest.mark.parametrize("module, structure", [(MaskedAttention("padding"), {"is_causal": False}),
                                               (_CausalPadded(), {"is_causal": True})],
                         ids=["padding", "causal_and_padding"])
def test_before_expected_padding_mask_becomes_the_key_padding_operand(module, structure):
    before = _recognised(module)  # attention(q, k, v, <mask computed from padding>)
    expected = Graph()
    expected.in_spec, expected.out_spec = before.in_spec, before.out_spec
    for name in ("q", "k", "v"):
        expected.add_input(name, _QKV)
    expected.add_input("padding", TensorSpec((2, 8), torch.int64))
    # the model's own test of the padding stays (here .bool()), viewed as [batch, keys]; the
    # [B, 1, S, S] mask is gone
    expected.add_node(Node("u1", "unsqueeze", "aten.unsqueeze.default", (Ref("padding"), 1), {},
                           TensorSpec((2, 1, 8), torch.int64)))
    expected.add_node(Node("u2", "unsqueeze", "aten.unsqueeze.default", (Ref("u1"), 2), {},
                           TensorSpec((2, 1, 1, 8), torch.int64)))
    expected.add_node(Node("keep", "cast", "aten.to.dtype", (Ref("u2"), torch.bool), {},
                           TensorSpec((2, 1, 1, 8), torch.bool)))
    expected.add_node(Node("keys", "view", "aten.reshape.default", (Ref("keep"), [2, 8]), {},
                           TensorSpec((2, 8), torch.bool)))
    expected.add_node(Node("out", "attention", None, (Ref("q"), Ref("k"), Ref("v"), None),
                           {"scale": 1.0 / math.sqrt(16), **structure, "key_padding": Ref("keys")}, _QKV))
    expected.outputs = [Ref("out")]
    assert_structural_equal(describe_key_padding(before), expected)


def test_before_expected_query_dependent_masks_are_unchanged():
    before = _recognised(MaskedAttention("query"))
    assert_structural_equal(describe_key_padding(before), before, map_free_names=False)


class Probed(torch.nn.Module):
    """Masks whose meaning only 0/1 probes of every key can tell from key padding."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, q, k, v, padding):
        hidden = 1.0 - padding[:, None, None, :].float()
        if self.how == "bias only with padding":  # 0 when every key is kept
            mask = hidden * torch.finfo(torch.float32).min + 0.7 * hidden.cumsum(-1)
        elif self.how == "causal only without padding":
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            mask = padding[:, None, None, :].bool() & (causal | (padding.sum() < padding.numel()))
        elif self.how == "first key decides a bias":  # left padding changes the scores
            mask = hidden * -1e9 + (1.0 - padding[:, :1].float())[:, None, None, :] * 0.5
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("how", ["bias only with padding", "causal only without padding",
                                 "first key decides a bias"])
def test_masks_that_differ_from_key_padding_somewhere_stay_tensors(how):
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    reports = PassReports()
    run_passes(trace(Probed(how), (q, k, v, torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))), reports)
    assert not reports.padding.rewritten, reports.padding


@pytest.mark.parametrize("is_causal, window", [(False, None), (True, None), (True, 3)])
def test_empty_query_rows_are_the_rows_the_dense_mask_leaves_empty(is_causal, window):
    """What the compiled step computes per call from the key padding alone (O(B x S)), against
    the dense mask the reference builds, for left, right, inner and full padding."""
    from stof_cc.ir.reference import empty_query_rows

    valid = torch.rand(6, 12) < 0.5
    valid[0], valid[1] = False, True
    valid[2, :9] = False  # left padding: early queries see no key under causal
    distance = torch.arange(12)[:, None] - torch.arange(12)[None, :]
    static = torch.ones(12, 12, dtype=torch.bool)
    if is_causal:
        static &= distance >= 0
    if window is not None:
        static &= distance <= window
    want = ~(static[None] & valid[:, None, :]).any(-1)
    got = empty_query_rows(valid, 12, is_causal, window)
    assert got.shape == (6, 1, 12, 1) and torch.equal(got[:, 0, :, 0], want)


def test_a_row_of_padding_keeps_the_bias_a_small_bias_gives_it():
    """A float mask of a learned bias plus the padding's -2e4: eager gives a query whose keys are all
    padding softmax(scores + bias) V (the fill shifts the row alike). "Unmasked" (no bias) came within
    the probe's tolerance for a small bias and the compiled row lost it (2.5e-2 off: a helper's hunt);
    beside a bias the mask now stays a tensor, and the compiled model gives eager's rows."""
    import stof_cc

    class BiasedPadding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)
            self.relative = torch.nn.Parameter(torch.randn(1, 2, 16, 16) * 0.02)

        def forward(self, x, attention_mask):
            batch, seq, width = x.shape
            q, k, v = self.qkv(x).view(batch, seq, 3, 2, width // 2).permute(2, 0, 3, 1, 4)
            mask = self.relative + (attention_mask == 0)[:, None, None, :].float() * -20000.0
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return out.transpose(1, 2).reshape(batch, seq, width)

    torch.manual_seed(0)
    model, x = BiasedPadding().eval(), torch.randn(2, 16, 64)
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, 10:] = 0
    with torch.no_grad():
        compiled = stof_cc.compile(model, (x, attention_mask), dtype=torch.float32, tune=False, cuda_graphs=False)
        attention_mask[1] = 0  # the second sequence all padding
        torch.testing.assert_close(compiled(x, attention_mask), model(x, attention_mask), rtol=1e-5, atol=1e-5)


class _WindowedAdditive(torch.nn.Module):
    """A decoder's additive [1, 1, S, S] mask (a causal band of 3), shared by every head."""

    def forward(self, q, k, v):
        s = q.shape[-2]
        rows, cols = torch.arange(s)[:, None], torch.arange(s)[None, :]
        band = (rows >= cols) & (rows - cols <= 3)
        bias = torch.zeros(1, 1, s, s).masked_fill(~band, torch.finfo(torch.float32).min)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def test_the_probes_read_the_mask_at_its_own_shape_not_once_per_head(monkeypatch):
    """A [1, 1, S, S] mask before 32 heads is probed as it is: expanded per head, the probes of a
    16384-token tensor-parallel Llama held 8.6 G elements and ran minutes per layer on the host."""
    probed = []
    split = key_padding_module._split
    monkeypatch.setattr(key_padding_module, "_split", lambda value: probed.append(tuple(value.shape)) or split(value))
    q, k, v = (torch.randn(1, 32, 64, 16) for _ in range(3))
    graph = recognise_attention(canonicalize(trace(_WindowedAdditive(), (q, k, v))))
    described = describe_key_padding(graph)
    attention = next(node for node in described.nodes() if node.op == "attention")
    assert attention.kwargs.get("is_causal") is True and attention.kwargs.get("window") == 3
    assert attention.args[3] is None
    assert probed and all(shape[1] == 1 for shape in probed), probed
    torch.testing.assert_close(interpret(described, q, k, v), _WindowedAdditive()(q, k, v), rtol=1e-5, atol=1e-5)


class _TwoLayersOneMask(torch.nn.Module):
    """Two attention layers reading one mask, as a decoder's layers read the one its forward built."""

    def forward(self, q, k, v, padding):
        causal = torch.ones(8, 8, dtype=torch.bool).tril()
        mask = padding[:, None, None, :].bool() & causal
        first = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.nn.functional.scaled_dot_product_attention(first, k, v, attn_mask=mask)


def test_a_mask_that_every_layer_reads_is_probed_once(monkeypatch):
    calls = []
    describe = key_padding_module._describe
    monkeypatch.setattr(key_padding_module, "_describe", lambda *args: calls.append(args[1].name) or describe(*args))
    graph = _recognised(_TwoLayersOneMask())
    described = describe_key_padding(graph)
    attentions = [node for node in described.nodes() if node.op == "attention"]
    assert len(attentions) == 2 and len(calls) == 1
    assert all(node.kwargs.get("is_causal") is True and node.kwargs.get("key_padding") is not None for node in attentions)
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    padding = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    torch.testing.assert_close(interpret(described, q, k, v, padding), _TwoLayersOneMask()(q, k, v, padding),
                               rtol=1e-5, atol=1e-5)


class _MixedFills(torch.nn.Module):
    """A causal part hidden with one value and the padding with another: a left-padded query that
    sees no key attends the least hidden keys (here its future tokens), as softmax decides."""

    def __init__(self, causal_fill: float, padding_fill: float) -> None:
        super().__init__()
        self.causal_fill, self.padding_fill = causal_fill, padding_fill

    def forward(self, q, k, v, attention_mask):
        causal = torch.ones(8, 8, dtype=torch.bool).tril()
        mask = torch.where(causal, 0.0, self.causal_fill)[None, None]
        mask = mask.masked_fill((attention_mask == 0)[:, None, None, :], self.padding_fill)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("causal_fill, padding_fill", [(torch.finfo(torch.float32).min, float("-inf")),
                                                       (-1e9, torch.finfo(torch.float32).min)])
def test_a_mask_hiding_keys_with_different_values_stays_a_tensor(causal_fill, padding_fill):
    """Described as causal + key padding, the rows of a left-padded sequence's padding got 0 or the
    mean of every V instead of the model's answer (found by review)."""
    model = _MixedFills(causal_fill, padding_fill)
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    right = torch.ones(2, 8, dtype=torch.long)
    right[1, 5:] = 0
    report = KeyPaddingReport()
    graph = describe_key_padding(recognise_attention(canonicalize(trace(model, (q, k, v, right)))), report)
    assert not report.rewritten and report.refused  # the mask stays the model's tensor
    left = torch.ones(2, 8, dtype=torch.long)
    left[0, :3] = 0  # rows 0-2 of the first sequence see no key under causal & padding
    torch.testing.assert_close(interpret(graph, q, k, v, left), model(q, k, v, left))
