"""A compiled module never answers with weights the model no longer has: it shares the model's
tensors where it can, and compiles again when PyTorch's own bookkeeping (version counters, storage
views, identities) says a parameter, buffer or submodule changed (runtime/weights.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import stof_cc
from stof_cc.loading import load_factory


def _block(example_path):
    module, (x,), _ = load_factory(example_path("gpt2_block"))
    return module, x


def _changes():
    """In-place and structural changes a user makes after compiling, each one PyTorch tracks."""
    def in_place(m):
        with torch.no_grad():
            m.mlp[0].weight.mul_(2)

    def load_state_dict(m):
        fresh = copy.deepcopy(m)
        for p in fresh.parameters():
            torch.nn.init.normal_(p, std=0.05)
        m.load_state_dict(fresh.state_dict())

    def new_parameter(m):
        m.mlp[2].weight = torch.nn.Parameter(torch.randn_like(m.mlp[2].weight))

    def new_submodule(m):
        m.mlp[0] = torch.nn.Linear(m.mlp[0].in_features, m.mlp[0].out_features)

    def data_assignment(m):
        m.ln_1.weight.data = torch.randn_like(m.ln_1.weight)

    def data_view_from_the_first_element(m):  # same address, version and dtype: other strides (found by review)
        m.attn.proj.weight.data = m.attn.proj.weight.data.t()

    def buffer_in_place(m):
        m.attn.causal.logical_not_().logical_not_()  # written in place, same values: still noticed
        with torch.no_grad():
            m.ln_2.bias.add_(1.0)

    return {f.__name__: f for f in (in_place, load_state_dict, new_parameter, new_submodule, data_assignment,
                                     data_view_from_the_first_element, buffer_in_place)}


@pytest.mark.parametrize("change", sorted(_changes()))
def test_a_change_after_compiling_compiles_again_and_says_so(change, example_path):
    module, x = _block(example_path)
    compiled = stof_cc.compile(module, (x,), dtype=torch.float32)
    compiled(x)
    _changes()[change](module)
    with pytest.warns(UserWarning, match="changed since it was compiled"):
        got = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing changed since: no second compile
        compiled(x)


def test_weights_in_the_compile_dtype_are_shared_not_copied(example_path):
    module, x = _block(example_path)
    compiled = stof_cc.compile(module, (x,), dtype=torch.float32)
    assert compiled.module is module  # no second copy of the weights
    compiled(x)
    module.mlp[2].weight.data.mul_(3)  # a .data write is not tracked, but a shared weight is read live
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)


def test_refresh_reads_weights_written_through_data(example_path):
    """A write through ``.data`` goes around the version counter: ``refresh()`` is the way."""
    module, x = _block(example_path)
    with pytest.warns(UserWarning, match="float32; the compiled model runs in torch.bfloat16"):
        compiled = stof_cc.compile(module, (x,), dtype=torch.bfloat16)  # a converted copy
    module.mlp[0].weight.data.mul_(2)
    compiled.refresh()
    with torch.no_grad():
        want = module(x)
    assert stof_cc.ir.reference.relative_error(compiled(x), want) < 1e-2


def test_moving_the_model_compiles_again_from_where_it_is(example_path):
    module, x = _block(example_path)
    compiled = stof_cc.compile(module, (x,), dtype=torch.float32)
    module.double()
    with pytest.warns(UserWarning, match="changed since it was compiled"):
        got = compiled(x)
    assert got.dtype == torch.float32  # compile's dtype is the contract; the weights are the model's now
    with torch.no_grad():
        torch.testing.assert_close(got.double(), module(x.double()), rtol=1e-5, atol=1e-5)


def test_a_model_in_training_mode_is_compiled_for_inference_with_a_warning(example_path):
    module, x = _block(example_path)
    module.train()
    with pytest.warns(UserWarning, match="training mode"):
        compiled = stof_cc.compile(module, (x,), dtype=torch.float32)
    assert module.training and all(m.training for m in module.modules())  # the model's own mode is kept
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)


def test_the_backend_sees_an_in_place_update_after_the_first_call(example_path):
    """Under torch.compile the lifted weights are shared; the merged Q/K/V weight is derived
    from them at compile time, so an update must compile again, never mix old and new."""
    torch._dynamo.reset()
    module, x = _block(example_path)
    compiled = torch.compile(module, backend=stof_cc.backend(fallback="eager"), dynamic=False)
    with torch.no_grad():
        compiled(x)
        for p in module.attn.parameters():
            p.mul_(1.5)
        with pytest.warns(UserWarning, match="changed since it was compiled"):
            got = compiled(x)
        torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_on_the_gpu_an_update_is_seen_through_the_captured_graph(example_path):
    """On the GPU the compiled module replays a CUDA graph whose kernels read the weights: an
    in-place update compiles and captures again, and the answer is the updated model's."""
    module, x = _block(example_path)
    module = module.cuda().half()
    x = x.cuda().half()
    compiled = stof_cc.compile(module, (x,), tune=False)
    for _ in range(2):  # the second call replays the captured graph
        compiled(x)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.9)
        with pytest.warns(UserWarning, match="changed since it was compiled"):
            got = compiled(x)
        want = module.float()(x.float())
    assert stof_cc.ir.reference.relative_error(got, want) < 1e-2


class _PlainTensorAttribute(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = torch.tensor([2.0])  # a plain attribute, not a buffer: traced as a constant

    def forward(self, x):
        return x * self.c


def test_a_plain_tensor_attribute_written_in_place_compiles_again():
    """Tensors kept as plain attributes are watched as buffers are (read stale before: found by review)."""
    module, x = _PlainTensorAttribute(), torch.randn(4, 8)
    compiled = stof_cc.compile(module, (x,), dtype=torch.float32)
    torch.testing.assert_close(compiled(x), x * 2)
    module.c.fill_(5.0)
    with pytest.warns(UserWarning, match="'c' of the compiled model changed"):
        got = compiled(x)
    torch.testing.assert_close(got, x * 5)


class _HeldTensors(torch.nn.Module):
    """Tensors in a dict and a list attribute, which torch.export lifts as constants."""

    def __init__(self) -> None:
        super().__init__()
        self.tables, self.rows = {"scale": torch.full((8,), 2.0)}, [torch.full((8,), 1.0)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.tables["scale"] + self.rows[0]


@pytest.mark.parametrize("change", ["dict entry replaced", "list item replaced", "dict replaced", "written in place"])
def test_tensors_in_dict_and_list_attributes_are_watched(change):
    """A tensor held in a dict or list attribute and replaced kept its old value in the compiled
    model, with no warning (found by review)."""
    module, x = _HeldTensors(), torch.randn(4, 8)
    compiled = stof_cc.compile(module, (x,), dtype=torch.float32)
    torch.testing.assert_close(compiled(x), x * 2 + 1)
    if change == "dict entry replaced":
        module.tables["scale"] = torch.full((8,), 5.0)
    elif change == "list item replaced":
        module.rows[0] = torch.full((8,), 5.0)
    elif change == "dict replaced":
        module.tables = {"scale": torch.full((8,), 5.0)}
    else:
        module.tables["scale"].fill_(5.0)
    with pytest.warns(UserWarning, match="of the compiled model changed since it was compiled"):
        got = compiled(x)
    torch.testing.assert_close(got, module(x))


_OUTSIDE = torch.full((8,), 3.0)


class _ReadsAGlobal(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _OUTSIDE


def test_a_tensor_read_from_outside_the_model_is_said_at_compile():
    """A global the forward reads cannot be watched: compile says so, and how to refresh."""
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"the forward reads 1 tensor\(s\) held outside the model's parameters, "
                                         r"buffers and attributes \(f32\[8\]: a global.*call refresh\(\)"):
        compiled = stof_cc.compile(_ReadsAGlobal(), (x,), dtype=torch.float32)
    torch.testing.assert_close(compiled(x), x * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stof_cc.compile(_HeldTensors().eval(), (x,), dtype=torch.float32)  # watched: nothing to say


def test_inference_tensors_are_watched_or_refused_with_the_way_around_it():
    """Inference tensors have no version counter: the weight watch raised torch's bare "Inference
    tensors do not track version counter" before anything named the model (found by review). A
    tensor attribute made under inference_mode compiles and is watched (replaced: compiled again);
    parameters made there cannot be traced, and the error says what to do."""
    from stof_cc.ir.frontend import TraceError

    model, x = _PlainTensorAttribute().eval(), torch.randn(3, 8)
    with torch.inference_mode():
        model.c = torch.full((8,), 3.0)
    compiled = stof_cc.compile(model, (x,), dtype=torch.float32)
    torch.testing.assert_close(compiled(x), x * 3)
    model.c = torch.full((8,), 4.0)
    with pytest.warns(UserWarning, match="'c' of the compiled model changed"):
        torch.testing.assert_close(compiled(x), x * 4)
    with torch.inference_mode():
        linear = torch.nn.Linear(8, 8).eval()
    with pytest.raises(TraceError, match=r"made under torch.inference_mode\(\) \(inference tensors\), which "
                                         r"torch.export cannot trace: build or load the model outside it"):
        stof_cc.compile(linear, (x,), dtype=torch.float32)


class Rotary(torch.nn.Module):
    """HF's rotary embedding as an fp16 model holds it: the angles from an fp32 ``inv_freq``
    buffer (computed in fp32), the fp16 weights beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self.inv_freq[None, :].float()
        return self.proj(x) * torch.cat((angles, angles), -1).cos().to(x.dtype)


def test_a_buffer_the_model_keeps_in_its_own_dtype_stays_in_it():
    """An fp16 model with an fp32 ``inv_freq`` is shared as it is (its angles stay fp32: converted
    with the weights they were off by radians at 8k positions), with no warning; a model converted
    from fp32 converts that buffer with its weights, as ``.to(dtype)`` would, and ties stay tied."""
    torch.manual_seed(0)
    model = Rotary().half().eval()
    model.inv_freq = model.inv_freq.float()
    x, positions = torch.randn(4, 32, dtype=torch.float16), torch.arange(8000, 8004)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = stof_cc.compile(model, (x, positions))
    assert compiled.module is model and model.inv_freq.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, positions), model(x, positions), rtol=0, atol=0)

    wide = Rotary().eval()
    wide.tied = torch.nn.Linear(32, 32)
    wide.tied.weight = wide.proj.weight
    wide.tied.register_buffer("inv_freq", wide.inv_freq, persistent=False)  # one buffer, two modules
    with pytest.warns(UserWarning, match="weights are torch.float32"):
        converted = stof_cc.compile(wide, (x, positions))
    assert converted.module.inv_freq.dtype == torch.float16 and wide.inv_freq.dtype == torch.float32
    assert converted.module.tied.weight is converted.module.proj.weight
    assert converted.module.tied.inv_freq is converted.module.inv_freq


def test_floating_inputs_cast_for_a_model_without_weights_are_said():
    """A model without floating weights compiled in fp16 from fp32 inputs returns fp16: said once."""
    class Trig(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x) * 2

    with pytest.warns(UserWarning, match=r"example inputs are torch.float32; the compiled model casts"):
        compiled = stof_cc.compile(Trig(), (torch.randn(8),))
    assert compiled(torch.randn(8)).dtype == torch.float16


def test_a_view_from_the_first_element_is_a_change():
    """``p.data = p.data[:n]`` (a trimmed vocabulary) keeps the object, address, version and dtype the watch
    compared: the compiled module went on with the old shape, no warning (found by review)."""
    from stof_cc.runtime.weights import WeightWatch

    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False))
    watch = WeightWatch(model)
    assert watch.changed() is None
    model[0].weight.data = model[0].weight.data[:24]
    assert watch.changed() == "'0.weight'"
