"""Which step of a compiled model gives a wrong answer: `verify_steps` runs every step of one
variant as compiled (kernels, stof-cc's attention, cuBLAS) and, on the very same inputs, through
the torch references of the step's nodes, and reports the relative error of each value the step
leaves for later steps. The compiled values go on to the next step, so each error is the step's
own, not the sum of those before it: a wrong kernel shows as one large row. Slow (every node runs
twice, uncaptured); for debugging, never on a hot path. A step holding a collective (the
all-reduce of a tensor-parallel graph) runs once and is not compared: running it again would
be another collective, and its value is not complete before its wait. A model that writes into its
inputs or buffers (a cache, a step counter) is refused: every run writes again (found by review: its
buffers advanced three times per check, and each step was compared with its own written value)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from stof_cc.ir.interpret import bind_inputs, node_runner
from stof_cc.ir.reference import relative_error
from stof_cc.passes import cast_floating
from stof_cc.runtime.collectives import is_collective
from stof_cc.runtime.compiled import CompiledModule, _on_device_of, _signature


@dataclass(frozen=True)
class StepCheck:
    group: str  # the fusion group's name (as `explain()` lists it)
    kind: str  # how the step ran: "kernel", "attention", "library" or "torch"
    value: str  # the value compared
    error: float  # relative error of the compiled value against the step's torch reference
    note: str  # the step's note (template and parameters, or why it ran in torch)


def verify_steps(compiled: CompiledModule, *args: Any, **kwargs: Any) -> list[StepCheck]:
    """One `StepCheck` per value each step of ``compiled`` leaves for later steps, for these
    inputs (compiled for them first where they are a new shape)."""
    cast, cast_kwargs = cast_floating((args, kwargs), compiled.dtype)
    flat, spec = pytree.tree_flatten((cast, cast_kwargs))
    variant = compiled.variants.get(_signature(flat, spec))
    if variant is None:  # compile it first: a model that writes in place is refused before it runs again
        compiled(*args, **kwargs)
        variant = compiled.variants[_signature(flat, spec)]
    if variant.mutates:
        raise ValueError("verify_steps: the model writes into its inputs or buffers in place, and every run of a "
                         "step would write again; verify a copy of it that does not (e.g. without the cache)")
    args, kwargs = cast, cast_kwargs
    inputs = bind_inputs(variant.graph, args, kwargs)
    device = next((t.device for t in inputs.values()), torch.device("cpu"))
    env: dict[str, Any] = {**variant.constants_on(device), **inputs}
    checks = []
    with torch.no_grad(), _on_device_of(flat):
        for step in variant.steps:
            before = dict(env)
            compiled._run(variant.graph, step, env, device)
            if any(is_collective(variant.graph.node(name)) for name in step.group.nodes):
                continue
            want = _in_torch(compiled, variant.graph, step, before, device)
            for name in sorted(step.writes()):
                got = env.get(name)
                if isinstance(got, torch.Tensor) and got.is_floating_point() and name in want:
                    error = relative_error(got, want[name].to(got.dtype))
                    checks.append(StepCheck(step.group.name, step.kind, name, error, step.note))
    return checks


def _in_torch(compiled: CompiledModule, graph, step, env: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The step's nodes evaluated by their torch references on ``env`` (a copy): what the
    interpreter computes. An attention anchor under ``compile(mask=...)`` takes that mask, as the
    kernel does."""
    env = dict(env)
    for wait, (reduced, received) in step.adds_received.items():  # the all-reduced value the kernel sums as it reads
        env[wait] = env[reduced] + env[received]
    for name in step.group.nodes:
        node = graph.node(name)
        if step.mask is not None and name == step.group.anchor and compiled.mask is not None:
            env[name] = compiled._reference_attention(node, env)
        else:
            env[name] = node_runner(graph, node, device)(env)
    return env


def worst(checks: list[StepCheck], tolerance: float) -> list[StepCheck]:
    """The checks above ``tolerance``, in step order."""
    return [c for c in checks if c.error > tolerance or c.error != c.error]
