"""torch.export frontend and interpreter: the oracle equals eager PyTorch on the examples."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from stof_cc import GraphError, TraceError, interpret, trace
from stof_cc.ir.ops import OPAQUE
from stof_cc.loading import load_factory

EXAMPLES = ["tiny_bert", "gpt2_block", "encoder_layer"]


def _tensors(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _fresh_inputs(args, kwargs):
    """New random values of the traced shapes (integer inputs keep their range, masks their pattern)."""
    def refresh(t):
        if t.dtype.is_floating_point:
            return torch.randn_like(t)
        if t.dtype == torch.long and t.max() > 1:
            return torch.randint(0, int(t.max()) + 1, t.shape)
        return t.clone()
    return pytree.tree_map_only(torch.Tensor, refresh, (args, kwargs))


@pytest.mark.parametrize("name", EXAMPLES)
def test_interpret_matches_eager(name, example_path):
    module, args, kwargs = load_factory(example_path(name))
    graph = trace(module, args, kwargs)
    graph.verify()
    args, kwargs = _fresh_inputs(args, kwargs)
    with torch.no_grad():
        expected = module(*args, **kwargs)
        got = interpret(graph, *args, **kwargs)
    assert type(got) is type(expected)
    exp_t, got_t = _tensors(expected), _tensors(got)
    assert len(exp_t) == len(got_t) >= 1
    for e, g in zip(exp_t, got_t, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", EXAMPLES)
def test_trace_is_deterministic(name, example_path):
    module, args, kwargs = load_factory(example_path(name))
    assert str(trace(module, args, kwargs)) == str(trace(module, args, kwargs))


def test_tracing_restores_training_mode(example_path):
    module, args, kwargs = load_factory(example_path("encoder_layer"))
    module.train()
    trace(module, args, kwargs)
    assert module.training


def test_examples_have_no_unknown_ops(example_path):
    for name in EXAMPLES:
        module, args, kwargs = load_factory(example_path(name))
        graph = trace(module, args, kwargs)
        assert [n.target for n in graph.nodes() if n.op == OPAQUE] == [], name


def test_unregistered_aten_op_becomes_opaque_and_still_runs():
    class Cumulative(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=1) * 2

    x = torch.randn(3, 5)
    graph = trace(Cumulative(), (x,))
    assert [n.target for n in graph.nodes() if n.op == OPAQUE] == ["aten.cumsum.default"]
    torch.testing.assert_close(interpret(graph, x), torch.cumsum(x, dim=1) * 2)


def test_data_dependent_control_flow_names_the_line():
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # depends on values: not traceable
                return x * 2
            return x

    with pytest.raises(TraceError) as info:
        trace(Branchy(), (torch.randn(4),))
    message = str(info.value)
    assert "Branchy" in message and "test_frontend.py" in message and "what to try" in message
    assert "inputs: float32[4]" in message  # the call it could not trace


def test_a_value_read_into_a_python_number_is_named():
    """x / x.abs().max().item() failed deep in the shape rules ("shape rule failed:
    aten._local_scalar_dense.default"; a review): the error now says what the op does and what to try."""
    import stof_cc

    class Normalised(nn.Module):
        def forward(self, x):
            return x / x.abs().max().item()

    with pytest.raises(GraphError, match=r"reads a tensor's value into a Python number .* keep the value a tensor"):
        stof_cc.compile(Normalised(), (torch.randn(3),), dtype=torch.float32, tune=False)


def test_a_failure_outside_the_models_code_names_no_other_code_as_its_line():
    """A Linear given the wrong width, or a keyword-only argument left out, named a line of
    generated code (``<string>:1``) or of the standard library's ``inspect`` (a helper's audit)."""
    class Scaled(nn.Module):
        def forward(self, x, *, scale):
            return x * scale

    for module, args in ((nn.Linear(16, 16), (torch.randn(2, 15),)), (Scaled(), (torch.randn(2, 4),))):
        with pytest.raises(TraceError) as info:
            trace(module, args)
        first = str(info.value).splitlines()[0]
        assert first.startswith(f"torch.export could not trace {type(module).__name__}: "), first
        assert "<string>" not in first and "inspect.py" not in first and "stof_cc" not in first


def test_a_size_that_depends_on_values_names_the_op_and_the_line():
    """Boolean indexing traces (torch.export gives it an unbacked size), and crashed stof-cc's IR with
    a raw GuardOnDataDependentSymNode (a newcomer's review): a TraceError names it now."""
    class Selecting(nn.Module):
        def forward(self, x):
            return x[x > 0].sum()  # how many elements: known only at run time

    with pytest.raises(TraceError) as info:
        trace(Selecting(), (torch.randn(4, 8),))
    message = str(info.value)
    assert "aten.index.Tensor" in message and "x[x > 0]" in message and "torch.where" in message


def test_bad_example_inputs_are_named():
    with pytest.raises(TraceError, match="needs a torch.nn.Module"):
        trace(lambda x: x, (torch.randn(2),))
    with pytest.raises(TraceError, match="must be a tuple"):
        trace(nn.ReLU(), {"x": torch.randn(2)})
    with pytest.raises(TraceError, match=r"input args\[1\] is a int"):
        trace(nn.ReLU(), (torch.randn(2), 3))
    with pytest.raises(TraceError, match=r"kwargs\['attention_mask'\] is a NoneType; .* Leave it out"):
        trace(nn.ReLU(), (torch.randn(2),), {"attention_mask": None})  # once advised functools.partial


def test_interpret_checks_inputs():
    graph = trace(nn.Linear(4, 2), (torch.randn(3, 4),))
    with pytest.raises(GraphError, match=r"expected f32\[3,4\], got f32\[3,5\]"):
        interpret(graph, torch.randn(3, 5))
    with pytest.raises(GraphError, match="do not match the signature"):
        interpret(graph, torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(GraphError, match=r"pass them unpacked.*interpret\(graph, \*example_inputs\)"):
        interpret(graph, (torch.randn(3, 4),))  # trace's tuple handed on as it was (a newcomer's first try)


@pytest.mark.gpu
@pytest.mark.parametrize("name", EXAMPLES)
def test_interpret_on_gpu_matches_eager(name, example_path):
    module, args, kwargs = load_factory(example_path(name))
    graph = trace(module, args, kwargs)
    to_gpu = lambda tree: pytree.tree_map_only(torch.Tensor, lambda t: t.cuda(), tree)  # noqa: E731
    args, kwargs = to_gpu(args), to_gpu(kwargs)
    module = module.cuda()
    with torch.no_grad():
        expected = module(*args, **kwargs)
        got = interpret(graph, *args, **kwargs)
    for e, g in zip(_tensors(expected), _tensors(got), strict=True):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def test_a_prepared_node_reads_env_and_keeps_constants_where_they_are():
    """node_runner (the compiled model's torch steps): the same values as evaluate_node, a
    constant taken from env when there (no copy per call), Refs inside lists (cat) resolved."""
    from stof_cc.ir.graph import Ref
    from stof_cc.ir.interpret import evaluate_node, node_runner

    class CatAdd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x + self.w], dim=0).view(2, 12)

    x = torch.randn(4, 3)
    graph = trace(CatAdd(), (x,))
    env = {graph.inputs[0].name: x} | dict(graph.constants)
    cpu = torch.device("cpu")
    for node in graph.nodes():
        if node.op == "input":
            continue
        got = node_runner(graph, node, cpu)(env)
        assert torch.equal(got, evaluate_node(graph, node, env, cpu))
        if node.op == "constant":
            assert got is graph.constants[node.name]  # read from env, not copied
        env[node.name] = got
    (out,) = (env[r.name] for r in graph.outputs if isinstance(r, Ref))
    assert torch.equal(out, interpret(graph, x)) and any(n.op == "cat" for n in graph.nodes())


class _Branches(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


def test_a_failed_trace_prints_no_partial_graph(capsys):
    """torch.export printed the partial graph of a failed trace to stderr twice before the TraceError (a
    newcomer's reading): the TraceError says where the trace stopped, alone."""
    with pytest.raises(TraceError, match="could not trace _Branches"):
        trace(_Branches(), (torch.randn(4),))
    assert "def forward" not in capsys.readouterr().err


def test_use_cache_false_is_told_to_be_left_out_not_wrapped():
    """The most natural keyword for a HuggingFace decoder: the message sent users off to write a wrapper
    (found by a newcomer review)."""
    import stof_cc

    with pytest.raises(TraceError, match=r"kwargs\['use_cache'\] is False: leave it out.*switched off already"):
        stof_cc.compile(torch.nn.Linear(4, 4), (torch.randn(2, 4),), {"use_cache": False})


def test_a_transformer_encoder_probing_its_mask_names_torchs_line_and_what_to_pass():
    """nn.TransformerEncoder checks a mask's values for causality inside torch: the error named no place and
    said to make the branch static, which the user cannot (found by a newcomer review)."""
    import stof_cc

    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    causal = torch.nn.Transformer.generate_square_subsequent_mask(16)
    with pytest.raises(TraceError) as caught:
        stof_cc.compile(encoder, (torch.randn(2, 16, 32),), {"mask": causal}, dtype=torch.float32)
    message = str(caught.value)
    assert "torch/nn/modules/transformer.py" in message and "(torch's own code)" in message, message
    assert "is_causal=True" in message and "mask=stof_cc.masks.causal()" in message, message
