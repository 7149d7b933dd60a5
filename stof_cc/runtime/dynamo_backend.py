"""stof-cc as a torch.compile backend.

``torch.compile(model, backend="stof_cc")`` finds it through the ``torch_dynamo_backends`` entry
point (pyproject.toml; no import needed where stof-cc is pip-installed) or, from a checkout on
the path, once ``import stof_cc`` ran (`register_name`); ``torch.compile(model,
backend=stof_cc.backend(mask=..., tune=...))`` takes options. Dynamo hands over one FX graph per region between graph breaks, and
each goes down `stof_cc.compile`'s road (torch.export of the graph to ATen, the IR, fusion, kernels;
on the GPU its attention and fused groups run on stof-cc kernels, the rest through torch), in the
dtype of its floating inputs. Dynamo lifts the module's parameters and buffers into graph inputs;
they go back into the compiled graph as constants (the passes then see weights as weights and a
causal buffer as causal), compiled once per set of weight tensors: replacing a parameter
recompiles, and so does an in-place update of one (`runtime/weights.py`: what is noticed).

Tensor parallelism (a model parallelised with ``parallelize_module``: DTensor inputs) goes through
AOTAutograd first, which turns each rank's graph into plain ATen on its local shards with the
collectives as functional ops (``_c10d_functional.all_reduce``, ``wait_tensor``); that graph goes
down the same road, the collectives as torch steps between fused groups (`_parallel_route`).

A graph stof-cc cannot take runs on the fallback the user chose, ``"inductor"`` (the default:
what ``torch.compile`` would have run) or ``"eager"`` (the graph as traced), with one warning
naming the graph and the reason: symbolic shapes (compile with ``dynamic=False``), autograd on with
an input that requires grad, floating inputs of mixed dtypes, an input updated in place, or
anything `stof_cc.compile` refuses (a tensor-parallel graph's local graph: as traced).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import itertools
import operator
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stof_cc.masks import MaskDescription
from stof_cc.runtime.build import check_build_dir
from stof_cc.runtime.compiled import CompiledModule, check_switches
from stof_cc.runtime.compiled import compile as compile_module
from stof_cc.tune.database import check_database_argument

FALLBACKS = ("inductor", "eager")
# PyTorch's inference fast path for nn.TransformerEncoderLayer and nn.MultiheadAttention: one op per
# layer that dynamo records as it is, hiding the attention and the GEMMs from stof-cc's passes
FUSED_LAYER_OPS = ("_transformer_encoder_layer_fwd", "_native_multi_head_attention")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A graph compiled for this many sets of module tensors says so: dynamo hands one graph the layers of a
# loop (one set each: up to some hundreds), or a module whose tensor is replaced on every call.
MANY_WEIGHT_SETS = 256


class _FrozenWeights(torch.nn.Module):
    """The graph module with the inputs dynamo lifted from the module's parameters and buffers held
    as this module's own: constants to the export, so the IR sees weights and a causal buffer as
    such. Called with the graph's other tensor inputs (non-tensor inputs, which only a graph that
    never reads them gets this far with, are bound as given). `stof_cc.compile` shares these
    tensors (they are in the compile dtype) and watches them: an in-place update compiles the
    graph again."""

    def __init__(self, graph_module: torch.fx.GraphModule, inputs: Sequence[Any], slots: list[int],
                 name: str = "dynamo graph") -> None:
        super().__init__()
        self.graph_module, self.slots, self.arity = graph_module, set(slots), len(inputs)
        self.graph_name = name.replace(" ", "_")  # the traced graph's name: warnings and build_dir's folder say it
        self.bound = {i: x for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)}
        self.eval()  # dynamo traced the model in its own mode already: this wrapper's mode means nothing
        for i in slots:
            if isinstance(inputs[i], torch.nn.Parameter):
                self.register_parameter(f"input_{i}", inputs[i])
            else:
                self.register_buffer(f"input_{i}", inputs[i], persistent=False)

    def forward(self, *args: Any) -> Any:
        given = iter(args)
        return self.graph_module(*(getattr(self, f"input_{i}") if i in self.slots else
                                   self.bound[i] if i in self.bound else next(given) for i in range(self.arity)))


def _module_state_slots(graph_module: torch.fx.GraphModule) -> list[int]:
    """The graph inputs dynamo lifted from a module's parameters or buffers (by their source,
    L['self']._modules[...]._parameters['weight']; not tensors a user marked static, nor plain
    tensor attributes, which may change between calls)."""
    slots = []
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = source.name() if callable(getattr(source, "name", None)) else str(getattr(source, "name", ""))
        if "._parameters[" in name or "._buffers[" in name:
            slots.append(i)
    return slots


def _target_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def _is_parallel(inputs: Sequence[Any]) -> bool:
    """Whether the graph runs tensor parallelism (DTensor inputs: `_parallel_route` takes it)."""
    return any(type(x).__name__ == "DTensor" for x in inputs)


def _why_not(graph_module: torch.fx.GraphModule, inputs: Sequence[Any], slots: list[int]) -> str | None:
    """Why stof-cc cannot take this graph with these example inputs; None when it can. Non-tensor
    inputs the graph never reads (the DeviceMesh objects of a tensor-parallel rank's local graph)
    do not count; DTensor inputs are `_parallel_route`'s. A module buffer in a dtype of its own (HF's
    fp32 ``inv_freq`` beside fp16 weights) does not mix the dtypes: it keeps its dtype
    (`stof_cc.passes.lower.convert_weights`)."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    read = [x for x, node in zip(inputs, placeholders, strict=False) if node.users or isinstance(x, torch.Tensor)]
    if any(isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool) for x in inputs):
        return "it has symbolic shapes; compile with dynamic=False for stof-cc to take it"
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
        return ("autograd is on and an input requires grad (stof-cc's kernels record nothing for "
                "backward); run inference under torch.no_grad() or torch.inference_mode()")
    if _is_parallel(inputs):  # its DeviceMesh inputs go to AOTAutograd with it
        return None
    kinds = sorted({type(x).__name__ for x in read if not isinstance(x, torch.Tensor)})
    if kinds:
        return f"it takes non-tensor inputs ({', '.join(kinds)})"
    floating = _floating_dtypes(inputs, slots)
    if len(floating) > 1:
        return f"its floating inputs mix dtypes ({', '.join(sorted(str(d) for d in floating))})"
    if floating and next(iter(floating)) not in DTYPES:
        return f"its floating inputs are {next(iter(floating))} (stof-cc runs float16, bfloat16 and float32)"
    placeholders = {n for n in graph_module.graph.nodes if n.op == "placeholder"}
    for node in graph_module.graph.nodes:
        name = node.target if node.op == "call_method" else _target_name(node)
        if isinstance(name, str) and name.endswith("_") and not name.endswith("__") and node.args \
                and node.args[0] in placeholders:
            return f"it updates its input {node.args[0].name} in place ({name})"
    return None


def _floating_dtypes(inputs: Sequence[Any], slots: list[int]) -> set[torch.dtype]:
    """The floating dtypes of the graph's inputs that run in the compile dtype: all but its module
    buffers (`_module_state_slots` that are not parameters)."""
    buffers = {i for i in slots if not isinstance(inputs[i], torch.nn.Parameter)}
    return {x.dtype for i, x in enumerate(inputs)
            if i not in buffers and isinstance(x, torch.Tensor) and x.is_floating_point()}


def _compile_dtype(inputs: Sequence[Any], slots: list[int]) -> torch.dtype:
    """The dtype a graph compiles in: its floating inputs' (`_floating_dtypes`), or, in a graph
    whose only floating tensors are module buffers (``self.pe[pos] * 0.5``), theirs where they
    agree: an fp16 model's such graph ran in fp32 and returned fp32 (found by review)."""
    floating = _floating_dtypes(inputs, slots)
    if not floating:
        floating = {inputs[i].dtype for i in slots if isinstance(inputs[i], torch.Tensor)
                    and inputs[i].is_floating_point()} & set(DTYPES)
    return next(iter(floating)) if len(floating) == 1 else torch.float32


class _CompiledGraph:
    """One dynamo graph: stof-cc's compiled module per set of module weights (dynamo hands the
    same graph to another module instance, or to the layers of a loop, when their tensors look
    alike: the weights' identities pick the compiled module), or the fallback, with the reason."""

    names = itertools.count()  # graphs made in this process, for the warnings

    def __init__(self, graph_module: torch.fx.GraphModule, inputs: list[Any], options: dict[str, Any],
                 slots: list[int] | None = None, name: str | None = None) -> None:
        self.name = name or f"dynamo graph {next(_CompiledGraph.names)}"
        self.graph_module, self.options = graph_module, options
        self.compiled_for: dict[tuple[int, ...], CompiledModule] = {}
        self.delegate: Callable[..., Any] | None = None  # runs the graph instead: the fallback, or AOTAutograd's route
        self.local_graphs: list[_CompiledGraph] = []  # tensor parallelism: the local graph, once it ran
        self.slots = _module_state_slots(graph_module) if slots is None else slots
        self.reason = _why_not(graph_module, inputs, self.slots)
        if self.reason is None and _is_parallel(inputs):
            self.reason = self._parallel(inputs)
        elif self.reason is None:
            self.reason = self._compile(inputs)
        else:
            self._fall_back(inputs, self.reason)
        fused = sorted({_target_name(n) for n in graph_module.graph.nodes if _target_name(n) in FUSED_LAYER_OPS})
        if fused:
            warnings.warn(f"stof_cc backend: {self.name} calls PyTorch's fused layer kernel ({', '.join(fused)}: "
                          "the inference fast path of nn.TransformerEncoderLayer / nn.MultiheadAttention), which "
                          "runs as it is; call torch.backends.mha.set_fastpath_enabled(False) before the first "
                          "call for stof-cc to fuse the layer", stacklevel=2)

    @property
    def compiled(self) -> CompiledModule | None:
        """The compiled module of the first weights seen (a tensor-parallel graph's: its local
        graph's, once it ran; None on the fallback)."""
        if self.local_graphs:
            return self.local_graphs[0].compiled
        return next(iter(self.compiled_for.values()), None)

    def _compile(self, inputs: Sequence[Any]) -> str | None:
        """Compile for these inputs' weights; on failure, the fallback and the reason."""
        frozen = _FrozenWeights(self.graph_module, inputs, self.slots, self.name)
        dtype = _compile_dtype(inputs, self.slots)
        args = _given(inputs, self.slots)
        try:
            self.compiled_for[self._weights_key(inputs)] = compile_module(frozen, args, dtype=dtype,
                                                                          **self.options["compile"])
            return None
        except Exception as exc:  # any refusal: the graph keeps its meaning on the fallback
            reason = f"stof-cc could not compile it ({type(exc).__name__}: {exc})"
        self._fall_back(inputs, reason)
        return reason

    def _parallel(self, inputs: Sequence[Any]) -> str | None:
        """Tensor parallelism: `_parallel_route`; where AOTAutograd cannot take the graph, the fallback."""
        try:
            self.delegate = _parallel_route(self.graph_module, inputs, self.slots, self.options, self.name,
                                            self.local_graphs)
            return None
        except Exception as exc:  # the graph keeps its meaning on the fallback
            reason = f"AOTAutograd could not turn its DTensors into local shards ({type(exc).__name__}: {exc})"
        self._fall_back(inputs, reason)
        return reason

    def _fall_back(self, inputs: Sequence[Any], reason: str) -> None:
        warnings.warn(f"stof_cc backend: {self.name} runs on {self.options['fallback']}, because {reason}",
                      stacklevel=3)
        self.delegate = _fallback(self.graph_module, list(inputs), self.options["fallback"])

    def _weights_key(self, args: Sequence[Any]) -> tuple[int, ...]:
        return tuple(id(args[i]) for i in self.slots)

    def __call__(self, *args: Any) -> Any:
        if self.delegate is not None:
            return self.delegate(*args)
        compiled = self.compiled_for.get(self._weights_key(args))
        if compiled is None:  # another module's weights in the same graph: compiled for them too
            if self._compile(args) is not None:
                return self.delegate(*args)
            compiled = self.compiled_for[self._weights_key(args)]
            if len(self.compiled_for) == MANY_WEIGHT_SETS:
                warnings.warn(f"stof_cc backend: {self.name} has compiled for {MANY_WEIGHT_SETS} sets of module "
                              "tensors, each kept: a module tensor replaced on every call (a buffer reassigned in "
                              "forward, `self.n = self.n + 1`) compiles it again every time; update such a tensor "
                              "in place (`self.n.add_(1)`)", stacklevel=2)
        return compiled(*_given(args, self.slots))


def _given(inputs: Sequence[Any], slots: list[int]) -> tuple[torch.Tensor, ...]:
    """The inputs a compiled graph takes: the tensors that are not frozen weights (`_FrozenWeights`)."""
    frozen = set(slots)
    return tuple(x for i, x in enumerate(inputs) if i not in frozen and isinstance(x, torch.Tensor))


# The backend kernels AOTAutograd picks for scaled_dot_product_attention (a composite op it
# decomposes) with each one's positional (attn_mask, dropout_p, is_causal) after q, k, v; None:
# not among its arguments (-1: the mask is the keyword attn_mask).
_SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": (None, 3, 4),
    "_scaled_dot_product_flash_attention_for_cpu": (-1, 3, 4),
    "_scaled_dot_product_efficient_attention": (3, 5, 6),
    "_scaled_dot_product_cudnn_attention": (3, 5, 6),
}


def _heads(node: Any) -> int | None:
    """The head count (dim -3) of an attention operand in an AOTAutograd graph, from its fake value."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return int(value.shape[-3]) if isinstance(value, torch.Tensor) and value.dim() >= 3 else None


def _restore_sdpa(graph_module: torch.fx.GraphModule) -> int:
    """Put ``aten.scaled_dot_product_attention`` back where AOTAutograd decomposed it into the
    kernel it chose for the device (flash, efficient, cuDNN, CPU flash) and only its output is
    read, so stof-cc's attention pass finds the attention (and its mask and is_causal) as it does
    in an export. The graph's views then become reshapes: AOTAutograd traced them against the
    kernel's output strides (the CPU flash kernel's [B, S, H, D] layout made a ``view`` after a
    transpose valid), which the restored op need not have; the graph is functional, so a
    reshape computes the same values. Returns how many it restored."""
    restored = 0
    for node in list(graph_module.graph.nodes):
        kernel = getattr(node.target, "_overloadpacket", None)
        positions = _SDPA_KERNELS.get(getattr(kernel, "__name__", ""))
        if node.op != "call_function" or positions is None:
            continue
        users = list(node.users)
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
            continue  # the log-sum-exp or another output is read: leave the kernel
        mask_at, dropout_at, causal_at = positions
        given = dict(enumerate(node.args))
        mask = node.kwargs.get("attn_mask") if mask_at == -1 else given.get(mask_at)
        if given.get(dropout_at, 0.0):
            continue
        options = {"attn_mask": mask, "is_causal": bool(given.get(causal_at, False)), "scale": node.kwargs.get("scale")}
        q_heads, kv_heads = (_heads(arg) for arg in node.args[:2])
        if q_heads is None or kv_heads is None:
            continue  # shapes unknown: leave the kernel
        if q_heads != kv_heads:  # grouped K/V handed to the kernel as they are (enable_gqa)
            options["enable_gqa"] = True
        with graph_module.graph.inserting_before(node):
            sdpa = graph_module.graph.call_function(torch.ops.aten.scaled_dot_product_attention.default,
                                                    node.args[:3], options)
        for user in users:
            user.replace_all_uses_with(sdpa)
            graph_module.graph.erase_node(user)
        graph_module.graph.erase_node(node)
        restored += 1
    if restored:
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and node.target in (torch.ops.aten.view.default,
                                                               torch.ops.aten._unsafe_view.default):
                node.target = torch.ops.aten.reshape.default
        graph_module.recompile()
    return restored


def _parallel_route(graph_module: torch.fx.GraphModule, inputs: Sequence[Any], slots: list[int],
                    options: dict[str, Any], name: str, compiled: list[_CompiledGraph]) -> Callable[..., Any]:
    """A tensor-parallel rank's graph: AOTAutograd (inference) desugars its DTensors into their local
    shards, with the collectives as functional ops, and hands over that plain graph, which
    `_CompiledGraph` compiles at its first call (real shards, not AOTAutograd's fake ones): the
    module's parameters (their local shards) frozen as weights, the collectives as torch steps.
    Where stof-cc cannot take the local graph, it runs as traced (AOTAutograd's graph is plain ATen:
    "eager" keeps its meaning exactly). ``compiled`` receives the local graph's `_CompiledGraph`."""
    from torch._functorch.aot_autograd import aot_module_simplified

    weights = {id(getattr(inputs[i], "_local_tensor", inputs[i])) for i in slots}
    local_options = {**options, "fallback": "eager"}

    def local_compiler(local_graph: torch.fx.GraphModule, _fake_inputs: list[Any]) -> Callable[..., Any]:
        _restore_sdpa(local_graph)

        def run(*args: Any) -> Any:
            if not compiled:
                frozen = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and id(x) in weights]
                compiled.append(_CompiledGraph(local_graph, list(args), local_options, slots=frozen,
                                               name=f"{name} (local shards)"))
            out = compiled[0](*args)
            return out if isinstance(out, tuple | list) else (out,)

        return run

    return aot_module_simplified(graph_module, list(inputs), fw_compiler=local_compiler)


def _fallback(graph_module: torch.fx.GraphModule, inputs: list[Any], name: str) -> Callable[..., Any]:
    """The graph as traced ("eager"), or Inductor's compilation of it."""
    if name == "eager":
        return graph_module.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph_module, inputs)


def backend(mask: MaskDescription | torch.Tensor | None = None, tune: bool = True, fallback: str = "inductor",
            cuda_graphs: bool = True, database: Any = None, build_dir: str | None = None) -> Callable[..., Any]:
    """A torch.compile backend with options: ``mask``, ``tune``, ``cuda_graphs``, ``database`` and
    ``build_dir`` as for `stof_cc.compile` (``mask`` applies to every graph's attention nodes);
    ``fallback`` ("inductor" or "eager") runs the graphs stof-cc cannot take."""
    if fallback not in FALLBACKS:
        raise ValueError(f"stof_cc.backend: fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    check_switches("stof_cc.backend", tune=tune, cuda_graphs=cuda_graphs)  # a string was taken as true
    if mask is not None and not isinstance(mask, (MaskDescription, torch.Tensor)):
        raise TypeError(f"stof_cc.backend: mask must be a stof_cc.masks description, a bool tensor or None, "
                        f"got {type(mask).__name__}")
    check_database_argument(database, "stof_cc.backend: database")
    check_build_dir(build_dir, "stof_cc.backend: build_dir")
    options = {"fallback": fallback,
               "compile": {"mask": mask, "tune": tune, "cuda_graphs": cuda_graphs, "database": database,
                           "build_dir": build_dir}}

    def stof_cc_backend(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return _CompiledGraph(graph_module, list(example_inputs), options)

    return stof_cc_backend


stof_cc_backend = backend()  # the entry point's: torch.compile(model, backend="stof_cc")


REGISTRY = "torch._dynamo.backends.registry"


def register_name() -> None:
    """Register ``"stof_cc"`` with dynamo's backend registry, now if it is loaded, else when it
    loads (`import stof_cc` calls this: importing dynamo here would cost every import of
    stof_cc about 2 s). Where stof-cc is pip-installed the entry point serves as well."""
    if REGISTRY in sys.modules:
        _register(sys.modules[REGISTRY])
    elif not any(isinstance(finder, _RegisterWhenLoaded) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLoaded())


def _register(registry: Any) -> None:
    """Register the name unless it is registered, or its entry point is being loaded right now
    (dynamo registers what the entry point gives once this import returns)."""
    if "stof_cc" not in registry._COMPILER_FNS and registry._BACKENDS.get("stof_cc") is None:
        registry.register_backend(compiler_fn=stof_cc_backend, name="stof_cc")


class _RegisterWhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when dynamo's registry module is imported it has the normal finders
    locate it, and registers stof-cc's backend right after the module has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _register(module)

        spec.loader.exec_module = exec_module
        return spec
