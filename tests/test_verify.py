"""`verify_steps`: every step of a compiled model against the torch references of its nodes, on
the same inputs, so the one wrong step stands out."""

from __future__ import annotations

import pytest
import torch

import stof_cc
from stof_cc.loading import load_factory
from stof_cc.runtime.compiled import CompiledModule
from stof_cc.runtime.verify import verify_steps, worst


def test_every_step_of_a_model_run_in_torch_checks_at_zero(example_path):
    module, args, kwargs = load_factory(example_path("tiny_bert"))
    compiled = stof_cc.compile(module, args, kwargs, dtype=torch.float32)
    checks = verify_steps(compiled, *args, **kwargs)
    variant = next(iter(compiled.variants.values()))
    checked, steps = {c.group for c in checks}, {s.group.name for s in variant.steps}
    assert checked <= steps and len(checked) >= len(steps) - 1  # the one step left writes the integer padding
    assert worst(checks, 0.0) == []


def test_a_step_that_computes_something_else_is_the_one_named(example_path, monkeypatch):
    module, args, kwargs = load_factory(example_path("gpt2_block"))
    compiled = stof_cc.compile(module, args, kwargs, dtype=torch.float32)
    compiled(*args, **kwargs)
    variant = next(iter(compiled.variants.values()))
    broken = variant.steps[len(variant.steps) // 2]
    run = CompiledModule._run

    def wrong(self, graph, step, env, device):  # this step's values come out doubled
        run(self, graph, step, env, device)
        if step is broken:
            for name in step.writes():
                if isinstance(env.get(name), torch.Tensor) and env[name].is_floating_point():
                    env[name] = env[name] * 2

    monkeypatch.setattr(CompiledModule, "_run", wrong)
    checks = verify_steps(compiled, *args, **kwargs)
    bad = worst(checks, 1e-3)
    assert bad and {c.group for c in bad} == {broken.group.name}
    assert all(c.error == pytest.approx(1.0, rel=1e-4) for c in bad)  # each its own error, not carried on


@pytest.mark.gpu
def test_every_kernel_step_of_a_gpu_model_is_close_to_torch(half_on_gpu):
    module, args = half_on_gpu("gpt2_block")
    compiled = stof_cc.compile(module, args, tune=False)
    checks = verify_steps(compiled, *args)
    assert any(c.kind in ("kernel", "attention") for c in checks), compiled.explain()
    assert worst(checks, 1e-2) == [], checks


class _Ema(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        self.avg.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x - self.avg


def test_a_model_that_writes_its_buffers_is_refused():
    """Each of verify_steps' runs wrote the buffer again (three times per check) and compared a step with its
    own written value (found by review): refused, after the one call that compiles it."""
    x = torch.randn(2, 4)
    model = _Ema()
    compiled = stof_cc.compile(model, (x,), dtype=torch.float32, tune=False)
    before = model.avg.clone()
    with pytest.raises(ValueError, match="verify_steps: the model writes into its inputs or buffers"):
        verify_steps(compiled, x)
    torch.testing.assert_close(model.avg, before)  # compiled already: refused before any run
