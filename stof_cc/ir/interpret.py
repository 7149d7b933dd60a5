"""Run any Graph with torch, on the CPU or a GPU: the oracle every later stage is tested against.

Each node runs its own torch reference (its ATen overload, or its op's registered
reference), so the interpreter has no per-op code. Values are freed after their last
use, so a large model interprets in the memory eager mode would need.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.utils._pytree as pytree

from stof_cc.ir.graph import (
    CONSTANT,
    INPUT,
    Graph,
    GraphError,
    Node,
    Ref,
    TensorSpec,
)
from stof_cc.ir.node import iter_refs, map_refs
from stof_cc.ir.ops import reference_of


def interpret(graph: Graph, *args: Any, device: torch.device | str | None = None, **kwargs: Any) -> Any:
    """Evaluate ``graph`` on the given inputs and return the module's output structure.

    Inputs are checked against the traced signature (count, shape, dtype). Constants and
    device literals baked in at trace time (``aten.to(device=cpu)``, ``arange(device=...)``)
    follow ``device``, which defaults to the device of the first input tensor.
    """
    outputs, _ = _evaluate(graph, args, kwargs, device, set())
    if graph.out_spec is not None:
        return pytree.tree_unflatten(outputs, graph.out_spec)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def interpret_values(graph: Graph, names: Collection[str], *args: Any, device: torch.device | str | None = None,
                     **kwargs: Any) -> dict[str, Any]:
    """Evaluate ``graph`` like `interpret` and return the values of the nodes ``names`` (inputs,
    constants or computed): the inputs a fusion group's kernel reads, e.g. to tune it."""
    _, kept = _evaluate(graph, args, kwargs, device, set(names))
    missing = set(names) - set(kept)
    if missing:
        raise GraphError(f"graph {graph.name!r} has no node(s) {sorted(missing)}")
    return kept


def bind_inputs(graph: Graph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Input node name -> tensor, checked against the traced signature (count, shape, dtype)."""
    flat = _flatten_inputs(graph, args, kwargs)
    input_nodes = graph.inputs
    if len(flat) != len(input_nodes):
        raise GraphError(f"graph {graph.name!r} takes {len(input_nodes)} tensor inputs, got {len(flat)}")
    for node, value in zip(input_nodes, flat, strict=True):
        if not isinstance(value, torch.Tensor):
            raise GraphError(f"input %{node.name} must be a tensor, got {type(value).__name__}")
        if TensorSpec.of(value) != node.spec:
            raise GraphError(f"input %{node.name}: expected {node.spec}, got {TensorSpec.of(value)}")
    return dict(zip((n.name for n in input_nodes), flat, strict=True))


def evaluate_node(graph: Graph, node: Node, env: dict[str, Any], device: torch.device) -> Any:
    """The value of one node from its inputs in ``env``, by its torch reference; constants and
    device literals baked in at trace time follow ``device``."""
    return node_runner(graph, node, device)(env)


def node_runner(graph: Graph, node: Node, device: torch.device) -> Callable[[dict[str, Any]], Any]:
    """`evaluate_node` prepared once for repeated calls: the torch callable resolved, device
    literals retargeted and the argument positions that read ``env`` found up front (a compiled
    model's torch steps run every call; re-walking the arguments cost most of its host time).
    A constant is read from ``env`` when there (a compiled model keeps them on the device)."""
    if node.op == CONSTANT:
        def constant(env: dict[str, Any]) -> Any:
            return env[node.name] if node.name in env else graph.constants[node.name].to(device)
        return constant
    fn = reference_of(node)

    def retarget(value: Any) -> Any:
        return device if isinstance(value, torch.device) else value

    args = [retarget(a) for a in node.args]
    kwargs = {k: retarget(v) for k, v in node.kwargs.items()}
    if all(isinstance(v, Ref) or next(iter_refs(v), None) is None for v in (*args, *kwargs.values())):
        arg_slots = [(i, a.name) for i, a in enumerate(args) if isinstance(a, Ref)]
        kwarg_slots = [(k, v.name) for k, v in kwargs.items() if isinstance(v, Ref)]

        def bind(env: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
            call_args, call_kwargs = list(args), dict(kwargs)
            for i, name in arg_slots:
                call_args[i] = retarget(env[name])
            for k, name in kwarg_slots:
                call_kwargs[k] = retarget(env[name])
            return call_args, call_kwargs
    else:  # Refs inside lists (cat, stack): walk the arguments per call
        def bind(env: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
            def lookup(ref: Ref) -> Any:
                return env[ref.name]

            return ([retarget(a) for a in map_refs(node.args, lookup)],
                    {k: retarget(v) for k, v in map_refs(node.kwargs, lookup).items()})

    def run(env: dict[str, Any]) -> Any:
        call_args, call_kwargs = bind(env)
        try:
            return fn(*call_args, **call_kwargs)
        except Exception as exc:
            raise GraphError(f"node %{node.name} ({node.op}, {node.target}) failed: {exc}") from exc
    return run


def _evaluate(graph: Graph, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device | str | None,
              keep: set[str]) -> tuple[list[Any], dict[str, Any]]:
    feed = bind_inputs(graph, args, kwargs)
    first = next(iter(feed.values()), None)
    target_device = torch.device(device) if device is not None else (first.device if first is not None
                                                                      else torch.device("cpu"))
    env: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    last_use = _last_uses(graph)
    for index, node in enumerate(graph.nodes()):
        env[node.name] = feed[node.name] if node.op == INPUT else evaluate_node(graph, node, env, target_device)
        if node.name in keep:
            kept[node.name] = env[node.name]
        for name in last_use.get(index, ()):
            env.pop(name, None)

    return [env[r.name] if isinstance(r, Ref) else r for r in graph.outputs], kept


def _flatten_inputs(graph: Graph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    flat, spec = pytree.tree_flatten((args, kwargs))
    if graph.in_spec is not None and spec != graph.in_spec:
        hint = ""
        if len(args) == 1 and isinstance(args[0], (tuple, list)) \
                and pytree.tree_flatten(((*args[0],), kwargs))[1] == graph.in_spec:
            hint = ("\n  the inputs came as one tuple: pass them unpacked, as the module takes them: "
                    "interpret(graph, *example_inputs)")
        raise GraphError(
            f"inputs do not match the signature graph {graph.name!r} was traced with:\n"
            f"  expected {graph.in_spec}\n  got      {spec}{hint}"
        )
    return flat


def _last_uses(graph: Graph) -> dict[int, list[str]]:
    """Node index -> names whose value is dead after that node (graph outputs never die)."""
    order = {n.name: i for i, n in enumerate(graph.nodes())}
    keep = {r.name for r in graph.outputs if isinstance(r, Ref)}
    dies: dict[int, list[str]] = {}
    for node in graph.nodes():
        if node.name in keep:
            continue
        users = graph.users(node.name)
        at = max((order[u.name] for u in users), default=order[node.name])
        dies.setdefault(at, []).append(node.name)
    return dies
