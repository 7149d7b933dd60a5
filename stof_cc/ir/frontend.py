"""torch.nn.Module + example inputs -> Graph, through torch.export.

One tracer on purpose: torch.export yields ATen operators with one calling convention,
so the op registry needs one alias table. (fx.symbolic_trace would hand us torch-level
functions, tensor methods and submodules: a second table for the same ops, and it
fails on every module export fails on.) Parameters and buffers become CONSTANT nodes;
an ATen op with no registry entry becomes an ``opaque`` node that runs through torch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec
from stof_cc.ir.ops import canonical_op, spec_of_value
from stof_cc.ir.paths import path_component


class TraceError(RuntimeError):
    """The module or its example inputs cannot be turned into a Graph; says what to try."""


_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_STOF_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trace(
    module: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
) -> Graph:
    """Trace ``module`` for inference into a Graph.

    The module is traced in eval mode (dropout off) and restored to its previous mode.
    ``example_inputs`` is a tuple of positional arguments (a lone tensor is accepted);
    ``kwargs`` holds keyword arguments. Leaves must be tensors (leave out an argument that is
    None): shapes and dtypes are fixed by the example, as in every later stage.
    """
    if not isinstance(module, torch.nn.Module):
        raise TraceError(f"trace() needs a torch.nn.Module, got {type(module).__name__}")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(args, (tuple, list)):
        raise TraceError(
            f"example_inputs must be a tuple of tensors (or one tensor), got {type(example_inputs).__name__}"
        )
    kwargs = dict(kwargs or {})
    _check_leaves(tuple(args), kwargs)

    was_training = module.training
    module.eval()
    printed = io.StringIO()  # what export writes to stderr, passed on after it (`_passed_on`)
    try:
        with _caches_off(module, kwargs), _quiet_fake_tensor_errors(), contextlib.redirect_stderr(printed):
            exported = torch.export.export(module, tuple(args), kwargs=kwargs)
    except Exception as exc:  # export raises many types; all mean "could not trace"
        _passed_on(printed.getvalue(), getattr(exc, "partial_fx_graph", None))
        raise TraceError(_explain_export_failure(module, exc) + f"\n  inputs: {_describe(tuple(args), kwargs)}") from exc
    finally:
        module.train(was_training)
    _passed_on(printed.getvalue(), None)
    return from_exported(exported, name or getattr(module, "graph_name", None) or type(module).__name__)


def _passed_on(printed: str, partial_graph: Any) -> None:
    """What torch.export wrote to stderr, written there now, but the partial graph of a failed trace: each of
    export's wrappers prints it (twice, about 20 lines each, before the TraceError that says where the trace
    stopped: found by a newcomer)."""
    if partial_graph is not None:
        printed = printed.replace(f"{partial_graph}\n", "")
    if printed.strip():
        sys.stderr.write(printed)


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Iterator[None]:
    """torch logs an op that fails under fake tensors (about 20 lines) before raising; the
    TraceError says it once, with the inputs."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _describe(args: tuple, kwargs: dict) -> str:
    """The call's tensors as dtype[shape] (other values by type), positional then by name."""
    def one(value: object) -> str:
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        return type(value).__name__
    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]) or "none"


@contextlib.contextmanager
def _caches_off(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> Iterator[None]:
    """A forward-only compile keeps no KV cache: HuggingFace models read ``config.use_cache``
    when the call does not say, and would return a cache object torch.export cannot hold.
    Set to False on every config of the module while tracing, then restored. Said where it changes
    the answer: transformers reads packed sequences from ``position_ids`` without an
    ``attention_mask`` only when no cache is on (found by review: the compiled model attended within
    each sequence, eager with its cache across them)."""
    configs = {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None
               and isinstance(getattr(c, "use_cache", None), bool)}
    saved = {key: config.use_cache for key, config in configs.items()}
    if any(saved.values()) and "attention_mask" not in kwargs and _restarts(kwargs.get("position_ids")):
        warnings.warn("stof_cc: the trace switches the model's KV cache off, and without a cache transformers reads "
                      "position_ids that restart at 0 as packed sequences (each attends only to itself), which it "
                      "does not with its cache on: the compiled model follows the model called with "
                      "use_cache=False (set config.use_cache = False to make eager agree, or pass attention_mask)",
                      stacklevel=4)
    try:
        for config in configs.values():
            config.use_cache = False
        yield
    finally:
        for key, config in configs.items():
            config.use_cache = saved[key]


def _restarts(position_ids: Any) -> bool:
    """Whether ``position_ids`` restart somewhere (steps other than +1): packed sequences to transformers."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] < 2 or position_ids.is_meta:
        return False
    return bool((position_ids[..., 1:] - position_ids[..., :-1] != 1).any())


def _check_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            where = _describe_path(path)
            if where == "kwargs['use_cache']" and leaf is False:  # the most natural keyword (found by a newcomer review)
                raise TraceError("input kwargs['use_cache'] is False: leave it out. stof-cc traces a HuggingFace "
                                 "model with its KV cache switched off already (docs/huggingface.md), and traces "
                                 "tensor inputs only.")
            fix = ("Leave it out where it is the argument's default (an omitted keyword), or bind it inside "
                   "the module" if leaf is None else "Bind non-tensor arguments inside the module")
            raise TraceError(f"input {where} is a {type(leaf).__name__}; stof-cc traces tensor inputs only. {fix} "
                             "(a small nn.Module wrapper whose forward passes it on).")


def _describe_path(path: tuple[Any, ...]) -> str:
    """``((SequenceKey(0), SequenceKey(2)))`` -> ``args[2]``; kwargs -> ``kwargs['mask']``."""
    head = "args" if path and getattr(path[0], "idx", None) == 0 else "kwargs"
    return head + "".join(str(k) for k in path[1:])


def _model_frame(filename: str) -> bool:
    """A frame of the model's code: not torch's, stof-cc's, the standard library's (``inspect``
    binding the arguments) nor generated code (``<string>``), which named lines no user could find."""
    return not filename.startswith((_TORCH_DIR, _STOF_DIR, _STDLIB_DIR, "<"))


def _explain_export_failure(module: torch.nn.Module, exc: Exception) -> str:
    """Name the failing construct (the deepest frame outside torch) and what to try."""
    message = str(exc).strip().splitlines()
    first = message[0] if message else type(exc).__name__
    every = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in every if _model_frame(f.filename)]
    lowered = str(exc).lower()
    data_dependent = "data-dependent" in lowered or "guardondatadependent" in lowered or "could not guard" in lowered
    # a branch on values with no frame of the model's own is torch's (nn.TransformerEncoder probing whether a
    # mask is causal): its torch.nn line is named (nothing was: found by a newcomer review)
    inside_torch = [f for f in every if f.filename.startswith(os.path.join(_TORCH_DIR, "nn"))] \
        if data_dependent and not frames else []
    shown = frames[-1] if frames else inside_torch[-1] if inside_torch else None
    where = f" at {shown.filename}:{shown.lineno}" + (f" ({shown.line})" if shown.line else "") if shown else ""
    if inside_torch:
        where += " (torch's own code)"
    if data_dependent:
        hint = ("control flow or a shape depends on tensor values; make the branch static, "
                "or express it with torch.where / torch.cond")
        if "_detect_is_causal_mask" in "".join(f.name for f in every):  # nn.Transformer* inspects the mask
            hint = ("nn.TransformerEncoder / nn.Transformer check whether the mask is causal by its values: pass "
                    "is_causal=True beside a causal mask (a small nn.Module wrapper whose forward does), or give "
                    "stof_cc.compile mask=stof_cc.masks.causal() and no mask argument")
    elif "unsupported" in lowered:
        hint = "a Python construct torch.export cannot capture; move it out of forward()"
    elif "inference tensor" in lowered:
        hint = ("the model's parameters or buffers were made under torch.inference_mode() (inference tensors), "
                "which torch.export cannot trace: build or load the model outside it (torch.no_grad() is fine), "
                "or replace them by clones made outside it")
    else:
        hint = "check that forward() runs on the example inputs and uses only torch operations"
    return (f"torch.export could not trace {type(module).__name__}{where}: "
            f"{type(exc).__name__}: {first}\n  what to try: {hint}")


def from_exported(exported: ExportedProgram, name: str = "graph") -> Graph:
    """Convert an ExportedProgram (ATen graph) into a Graph named ``name`` made a path component:
    the name names the model's build folder, and it comes from users (a class name, FILE:FACTORY)."""
    graph = Graph(path_component(name))
    _inline_regions(exported.graph_module)
    signature = exported.graph_signature
    placeholder_kind = {spec.arg.name: spec for spec in signature.input_specs}

    for fx_node in exported.graph.nodes:
        if fx_node.op == "placeholder":
            _add_placeholder(graph, exported, fx_node, placeholder_kind[fx_node.name])
        elif fx_node.op == "call_function":
            graph.add_node(_convert_call(fx_node))
        elif fx_node.op == "output":
            _set_outputs(graph, fx_node, signature.output_specs)
        else:  # get_attr / call_module do not occur in exported ATen graphs
            raise TraceError(f"unexpected fx node {fx_node.format_node()} in exported graph")

    graph.in_spec = exported.call_spec.in_spec
    graph.out_spec = exported.call_spec.out_spec
    return graph


# higher-order ops that only scope their region (grad mode, a disabled autocast, a plain wrap):
# for inference in one dtype their body means the same inlined. target -> index of the submodule
_SCOPES = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4, "wrap": 0}


def _inline_regions(module: torch.fx.GraphModule) -> None:
    """Replace each scoping higher-order op (`_SCOPES`) by the nodes of its body, in place, so
    the passes see plain ATen ops (HuggingFace's rotary embeddings run in an autocast-disabled
    region). An autocast region that is enabled changes dtypes inside it: refused, named."""
    for node in list(module.graph.nodes):
        name = getattr(node.target, "__name__", None)
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator) \
                or name not in _SCOPES:
            continue
        at = _SCOPES[name]
        if name == "wrap_with_autocast" and node.args[2]:
            raise TraceError(f"%{node.name}: an enabled autocast region ({node.args[0]}, {node.args[1]}) inside "
                             "forward(); stof-cc compiles a model in one dtype (compile's dtype=): remove it")
        body = getattr(module, node.args[at].target)
        _inline_regions(body)
        env = dict(zip((n for n in body.graph.nodes if n.op == "placeholder"), node.args[at + 1:], strict=True))
        with module.graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "get_attr":  # a nested body, already inlined, or a constant: carry it over
                    target = f"{node.args[at].target}_{inner.target}"
                    setattr(module, target, getattr(body, inner.target))
                    env[inner] = module.graph.get_attr(target)
                elif inner.op == "output":
                    results = torch.fx.map_arg(inner.args[0], env.__getitem__)
                elif inner.op != "placeholder":
                    env[inner] = module.graph.node_copy(inner, env.__getitem__)
        for user in list(node.users):  # the region's results are read through getitem
            if user.target is not operator.getitem:
                raise TraceError(f"%{node.name}: {name} result read by {user.format_node()}")
            user.replace_all_uses_with(results[user.args[1]])
            module.graph.erase_node(user)
        submodule = node.args[at]
        module.graph.erase_node(node)
        if not submodule.users:
            module.graph.erase_node(submodule)
    module.recompile()


def _add_placeholder(graph: Graph, exported: ExportedProgram, fx_node: torch.fx.Node, spec: Any) -> None:
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
        tensor = exported.state_dict.get(spec.target)
        if tensor is None:  # non-persistent buffers live in constants
            tensor = exported.constants[spec.target]
        graph.add_constant(fx_node.name, tensor.detach(), spec.target)
    elif spec.kind == InputKind.CONSTANT_TENSOR:
        graph.add_constant(fx_node.name, exported.constants[spec.target].detach(), spec.target)
    elif spec.kind == InputKind.USER_INPUT:
        graph.add_input(fx_node.name, TensorSpec.of(fx_node.meta["val"]))
    else:
        raise TraceError(f"input {fx_node.name!r} of kind {spec.kind.name} is not supported (stateful modules?)")


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.add.Tensor"
    if getattr(target, "__module__", None) == "_operator":
        return f"operator.{target.__name__}"
    raise TraceError(
        f"operator {target!r} is not an ATen op; stof-cc cannot run it "
        "(higher-order ops such as torch.cond are not supported yet)"
    )


def _convert_call(fx_node: torch.fx.Node) -> Node:
    target = _target_name(fx_node.target)

    def to_value(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return Ref(value.name)
        if isinstance(value, (list, tuple)):
            return type(value)(to_value(v) for v in value)
        return value

    return Node(
        name=fx_node.name,
        op=canonical_op(target),
        target=target,
        args=tuple(to_value(a) for a in fx_node.args),
        kwargs={k: to_value(v) for k, v in fx_node.kwargs.items()},
        spec=_static_spec(fx_node, target),
    )


def _static_spec(fx_node: torch.fx.Node, target: str) -> Any:
    """The node's value spec; a TraceError naming the op and the model's line where a size depends on
    tensor values (boolean indexing, nonzero, masked_select): stof-cc's IR has static shapes."""
    value = fx_node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape) for v in values):
        trace = (fx_node.meta.get("stack_trace") or "").strip().splitlines()
        where = f"\n  {trace[-2].strip()}\n    {trace[-1].strip()}" if len(trace) >= 2 else ""
        raise TraceError(f"{target} makes a tensor whose size depends on tensor values (boolean indexing, nonzero, "
                         f"masked_select); stof-cc compiles static shapes.{where}\n  what to try: keep the shape "
                         "static, e.g. torch.where(cond, x, 0) instead of x[cond]")
    return spec_of_value(value)


def _set_outputs(graph: Graph, fx_node: torch.fx.Node, output_specs: list[Any]) -> None:
    values = fx_node.args[0]
    for value, spec in zip(values, output_specs, strict=True):
        if spec.kind != OutputKind.USER_OUTPUT:
            raise TraceError(f"the module mutates state ({spec.kind.name} of {spec.target}); "
                             "stof-cc compiles stateless inference modules")
        graph.outputs.append(Ref(value.name) if isinstance(value, torch.fx.Node) else value)
