"""torch.compile(model, backend="stof_cc"): registered by entry point, each dynamo graph down
stof_cc.compile's road (on the CPU its groups run through torch), graph breaks, the fallbacks
and their warnings, autograd left to the fallback."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import stof_cc
from stof_cc.runtime import dynamo_backend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt2_block import GPT2Block  # noqa: E402


def capturing(**options):
    """A stof_cc backend that keeps the graphs it made, for the tests to look into."""
    made = []
    inner = stof_cc.backend(**options)

    def compile_graph(graph_module, example_inputs):
        made.append(inner(graph_module, example_inputs))
        return made[-1]

    return compile_graph, made


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_backend_is_found_by_name_through_its_entry_point():
    # pyproject's torch_dynamo_backends entry point (the editable install carries it)
    assert torch._dynamo.lookup_backend("stof_cc") is dynamo_backend.stof_cc_backend
    assert "stof_cc" in torch._dynamo.list_backends(exclude_tags=())


def test_import_stof_cc_registers_the_backend_name_without_the_entry_point():
    """From a checkout on PYTHONPATH there is no entry point: ``import stof_cc`` registers the
    name when dynamo's registry loads (and does not import dynamo itself)."""
    import subprocess
    import sys

    code = (
        "import importlib.metadata as md, sys\n"
        "found = md.entry_points\n"
        "md.entry_points = lambda **kw: [] if kw.get('group') == 'torch_dynamo_backends' else found(**kw)\n"
        "import stof_cc\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "import torch\n"
        "assert torch._dynamo.lookup_backend('stof_cc') is stof_cc.runtime.dynamo_backend.stof_cc_backend\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    # and with the entry point, stof_cc not imported first: the entry point's import registers nothing twice
    code = ("import torch\n"
            "compiled = torch.compile(torch.nn.Linear(4, 4), backend='stof_cc', dynamic=False)\n"
            "compiled(torch.randn(2, 4))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_decoder_block_goes_down_stof_cc_s_road_and_matches_eager():
    torch.manual_seed(0)
    model = GPT2Block().eval()
    x = torch.randn(2, 16, 128)
    backend, made = capturing(fallback="eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no graph on the fallback
        got = compiled(x)
        want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(made) == 1 and made[0].compiled is not None
    # the lifted causal buffer was frozen into the graph: the attention is recognised as such
    assert " attention " in made[0].compiled.explain()


class WithGraphBreaks(torch.nn.Module):
    """A print and a data-dependent branch in the forward: dynamo splits it into graphs."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.block = GPT2Block(hidden=hidden, heads=4, max_seq=32)
        self.head = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        print("between the graphs")
        if h.sum() > 0:
            return self.head(h)
        return -self.head(h)


@pytest.mark.parametrize("sign", (1.0, -1.0))
def test_graph_breaks_just_work(sign, capsys):
    torch.manual_seed(1)
    model = WithGraphBreaks().eval()
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        model.head.bias.fill_(sign * 10.0)  # decides the branch
        backend, made = capturing(fallback="eager")
        got = torch.compile(model, backend=backend, dynamic=False)(x)
        want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(made) >= 2 and all(g.compiled is not None for g in made)
    assert "between the graphs" in capsys.readouterr().out


def test_symbolic_shapes_run_on_the_fallback_with_the_reason():
    torch.manual_seed(2)
    model = GPT2Block(hidden=64, heads=4, max_seq=64).eval()
    backend, made = capturing(fallback="eager")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 12, 64)
    with torch.no_grad(), pytest.warns(UserWarning, match="runs on eager, because .*dynamic=False"):
        got = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    assert made and all(g.compiled is None for g in made)


def test_with_autograd_on_the_fallback_runs_and_gradients_flow():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    x = torch.randn(4, 16)
    backend, made = capturing(fallback="eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.warns(UserWarning, match="runs on eager, because autograd is on"):
        compiled(x).square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for g, w in zip(got, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(g, w)
    assert made[0].compiled is None  # dynamo guards on grad mode: an inference call gets its own graph
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert made[-1].compiled is not None


def test_a_graph_reused_for_other_weights_runs_with_them():
    """Dynamo hands one graph to every module whose tensors look alike (another instance, the
    layers of a loop): each set of weights gets its own compiled module."""
    torch.manual_seed(6)
    blocks = torch.nn.ModuleList(GPT2Block(hidden=64, heads=4, max_seq=32) for _ in range(3)).eval()

    def run(x):
        for block in blocks:
            x = block(x)
            torch._dynamo.graph_break()
        return x

    backend, made = capturing(fallback="eager")
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        got = torch.compile(run, backend=backend, dynamic=False)(x)
        want = run(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sum(len(g.compiled_for) for g in made) == 3


def test_graphs_stof_cc_cannot_take_run_on_the_fallback_with_the_reason():
    class Counts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2

    model = Counts()
    backend, _ = capturing(fallback="eager")
    with torch.no_grad(), pytest.warns(UserWarning, match="updates its input .* in place"):
        out = torch.compile(model, backend=backend, dynamic=False)(torch.ones(3))
    assert model.calls.item() == 1 and out.tolist() == [2.0, 2.0, 2.0]  # the buffer counted the call

    mixed = torch.nn.Linear(4, 4)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.warns(UserWarning, match="mix dtypes"):
        out = torch.compile(lambda x, y: mixed(x) + y, backend=capturing(fallback="eager")[0],
                            dynamic=False)(torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_a_buffer_in_a_dtype_of_its_own_does_not_send_the_graph_to_the_fallback():
    """An fp16 model keeping an fp32 ``inv_freq`` buffer (HF's Llama as loaded in fp16) runs on
    stof-cc, the buffer in fp32 as eager holds it (it went to the fallback as "mixed dtypes")."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).half().eval()
    model.register_buffer("inv_freq", torch.rand(16), persistent=False)
    backend, made = capturing(fallback="eager")
    x, positions = torch.randn(4, 16, dtype=torch.float16), torch.arange(8000, 8004)

    def run(x, positions):
        return model(x) * (positions[:, None].float() * model.inv_freq).cos().to(x.dtype)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.compile(run, backend=backend, dynamic=False)(x, positions)
        want = run(x, positions)
    assert made and all(g.delegate is None for g in made)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_graph_reading_only_buffers_keeps_their_dtype():
    """An fp16 model's graph whose only floating tensor is a buffer (``self.pe[pos] * 0.5`` before
    a graph break) compiled in fp32 and returned fp32 where eager returns fp16 (found by review)."""
    class Positions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)
            self.register_buffer("pe", torch.randn(64, 16))

        def forward(self, x, pos):
            pe = self.pe[pos] * 0.5
            print("", end="")  # a graph break: the first graph reads the buffer and pos only
            return self.proj(x) + pe

    torch.manual_seed(0)
    model = Positions().eval().half()
    x, pos = torch.randn(2, 8, 16, dtype=torch.float16), torch.arange(8)[None].repeat(2, 1)
    backend, made = capturing(fallback="eager")
    with torch.no_grad():
        got = torch.compile(model, backend=backend, dynamic=False)(x, pos)
        want = model(x, pos)
    assert made and all(g.delegate is None for g in made)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_a_tensor_replaced_on_every_call_is_said_once_it_has_compiled_many_times(monkeypatch):
    """``self.n = self.n + 1`` in forward hands the graph a new tensor every call: each call compiles
    again and every compile is kept (its key is the tensors' ids), silently (found by review)."""
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n = self.n + 1
            return self.fc(x) * self.n

    monkeypatch.setattr(dynamo_backend, "MANY_WEIGHT_SETS", 3)
    model, x = Counter().eval(), torch.randn(3, 16)
    compiled = torch.compile(model, backend=stof_cc.backend(fallback="eager"), dynamic=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [compiled(x) for _ in range(5)]
    said = [w for w in caught if "has compiled for 3 sets of module tensors" in str(w.message)]
    assert len(said) == 1 and "update such a tensor in place" in str(said[0].message)
    eager = Counter().eval()
    eager.load_state_dict({"fc.weight": model.fc.weight, "fc.bias": model.fc.bias, "n": torch.zeros(())})
    with torch.no_grad():
        for got in outputs:
            torch.testing.assert_close(got, eager(x))


def test_the_default_fallback_is_inductor():
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()).eval()
    x = torch.randn(4, 16)
    with torch.no_grad(), pytest.warns(UserWarning, match="runs on inductor, because .*dynamic=False"):
        got = torch.compile(model, backend="stof_cc", dynamic=True)(x)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))


def test_pytorch_s_fused_encoder_layer_op_is_named_with_the_way_around_it():
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, activation="gelu")
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 16, 64)
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1, 12:] = True
    with torch.no_grad():
        want = encoder(x, src_key_padding_mask=padding)
        with pytest.warns(UserWarning, match=r"_transformer_encoder_layer_fwd.*set_fastpath_enabled\(False\)"):
            got = torch.compile(encoder, backend="stof_cc", dynamic=False)(x, src_key_padding_mask=padding)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        enabled = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            backend, made = capturing(fallback="eager")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                got = torch.compile(encoder, backend=backend, dynamic=False)(x, src_key_padding_mask=padding)
        finally:
            torch.backends.mha.set_fastpath_enabled(enabled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert made[0].compiled is not None and " attention " in made[0].compiled.explain()


def test_options_are_checked():
    with pytest.raises(ValueError, match="fallback must be one of inductor, eager, got 'tensorrt'"):
        stof_cc.backend(fallback="tensorrt")
    with pytest.raises(TypeError, match="mask must be a stof_cc.masks description, a bool tensor or None, got str"):
        stof_cc.backend(mask="causal")
    with pytest.raises(TypeError, match="tune must be True or False, got 'yes'"):  # taken as true (a helper's audit)
        stof_cc.backend(tune="yes")
    with pytest.raises(TypeError, match="cuda_graphs must be True or False, got 0"):
        stof_cc.backend(cuda_graphs=0)


def test_database_and_build_dir_are_checked_when_the_backend_is_made(tmp_path):
    """Not at the first call, and not only where a GPU runs (issue 32, items 9 and 10)."""
    from stof_cc.tune.database import TuningDatabaseError

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(TypeError, match="stof_cc.backend: database must be a TuningDatabase, a file path or None, "
                                        "got int"):
        stof_cc.backend(database=12345)
    with pytest.raises(TuningDatabaseError, match=f"stof_cc.backend: database {tmp_path} is a directory"):
        stof_cc.backend(database=tmp_path)
    with pytest.raises(ValueError, match=f"stof_cc.backend: build_dir {tmp_path / 'notes.txt'} is a file, not a "
                                         "folder"):
        stof_cc.backend(build_dir=tmp_path / "notes.txt")


def test_a_huggingface_model_runs_under_the_backend():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                                           n_positions=64)).eval()
    ids = torch.randint(0, 100, (2, 16))
    backend, made = capturing(fallback="eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        got = compiled(input_ids=ids, use_cache=False).last_hidden_state
        want = model(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert made and all(g.compiled is not None for g in made), [g.reason for g in made]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_on_the_gpu_each_graph_runs_stof_cc_kernels_and_matches_eager(dtype):
    torch.manual_seed(5)
    model = WithGraphBreaks(hidden=128).eval().cuda().to(dtype)  # head dim 32: the kernels run it
    x = torch.randn(2, 32, 128, device="cuda", dtype=dtype)
    backend, made = capturing(fallback="eager", tune=False)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compiled(x)
        got_again = compiled(x)  # the second call replays the graph's CUDA graph
        want = model(x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_again, got)
    # (group, its kind, how it ran) for every group of every graph
    steps = [line.split()[:3] for g in made for line in g.compiled.explain().splitlines() if line.startswith("  g")]
    assert ["attention", "attention"] in [step[1:] for step in steps], steps  # stof_cc.attention's kernel
    assert sum(step[2] == "kernel" for step in steps) >= 3, steps  # the GEMM and norm groups


class _BreakThenAttend(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        torch._dynamo.graph_break()  # a print() or a host read does the same
        return torch.nn.functional.scaled_dot_product_attention(y, y, y)


def test_a_mask_given_to_the_backend_applies_past_a_graph_break_and_says_so():
    """The graph before the break has no attention: the warning named an internal class ('_FrozenWeights')
    and said the mask changed nothing, while the next graph ran under it (a newcomer's reading)."""
    from stof_cc import masks
    from stof_cc.ir.reference import masked_attention

    torch.manual_seed(0)
    x = torch.randn(1, 2, 16, 8)
    window = masks.sliding_window(2)
    with pytest.warns(UserWarning, match=r"graph 'dynamo_graph_\d+' has no attention node.*graph break"):
        got = torch.compile(_BreakThenAttend(), backend=stof_cc.backend(mask=window), dynamic=False)(x)
    want = masked_attention(x * 2, x * 2, x * 2, window.to_dense(16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
