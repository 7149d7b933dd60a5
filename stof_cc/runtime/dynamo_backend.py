"""stof-cc as a torch.compile backend.

``torch.compile(model, backend="stof_cc")`` finds it through the ``torch_dynamo_backends`` entry
point (pyproject.toml; no import needed); ``torch.compile(model, backend=stof_cc.backend(mask=...,
tune=...))`` takes options. Dynamo hands over one FX graph per region between graph breaks, and
each goes down `stof_cc.compile`'s road (torch.export of the graph to ATen, the IR, fusion, kernels;
on the GPU its attention and fused groups run on stof-cc kernels, the rest through torch), in the
dtype of its floating inputs. Dynamo lifts the module's parameters into graph inputs; they are
frozen into the compiled graph as the module's weights (what `stof_cc.compile` does with its copy
of the model): an in-place update of a weight after the first call is not seen.

A graph stof-cc cannot take runs on the fallback the user chose, ``"inductor"`` (the default:
what ``torch.compile`` would have run) or ``"eager"`` (the graph as traced), with one warning
naming the graph and the reason: symbolic shapes (compile with ``dynamic=False``), floating inputs
of mixed dtypes, or an operator or structure the frontend refuses.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stof_cc.ir.frontend import TraceError
from stof_cc.ir.graph import GraphError
from stof_cc.masks import MaskDescription
from stof_cc.runtime.compiled import CompiledModule
from stof_cc.runtime.compiled import compile as compile_module

FALLBACKS = ("inductor", "eager")
# PyTorch's inference fast path for nn.TransformerEncoderLayer and nn.MultiheadAttention: one op per
# layer that dynamo records as it is, hiding the attention and the GEMMs from stof-cc's passes
FUSED_LAYER_OPS = ("_transformer_encoder_layer_fwd", "_native_multi_head_attention")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _FrozenWeights(torch.nn.Module):
    """The graph module with the inputs dynamo lifted from the module (its parameters and buffers,
    which dynamo marks as static inputs) held as this module's own: constants to the export, so
    the IR sees weights and a causal buffer as such. Called with the graph's other inputs."""

    def __init__(self, graph_module: torch.fx.GraphModule, inputs: Sequence[Any]) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.weight_at = [i for i, x in enumerate(inputs) if _lifted_from_module(x)]
        for i in self.weight_at:
            if isinstance(inputs[i], torch.nn.Parameter):
                self.register_parameter(f"input_{i}", inputs[i])
            else:
                self.register_buffer(f"input_{i}", inputs[i], persistent=False)
        self.arity = len(inputs)

    def forward(self, *args: Any) -> Any:
        given = iter(args)
        return self.graph_module(*(getattr(self, f"input_{i}") if i in self.weight_at else next(given)
                                   for i in range(self.arity)))


def _lifted_from_module(x: Any) -> bool:
    """A parameter or buffer of the compiled module, lifted into a graph input by dynamo."""
    return isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) is not None


def _target_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def _why_not(inputs: Sequence[Any]) -> str | None:
    """Why stof-cc cannot take a graph with these example inputs; None when it can."""
    if any(not isinstance(x, torch.Tensor) for x in inputs):
        kinds = sorted({type(x).__name__ for x in inputs if not isinstance(x, torch.Tensor)})
        return (f"it takes non-tensor inputs ({', '.join(kinds)}): symbolic shapes; compile with "
                "dynamic=False for stof-cc to take it")
    floating = {x.dtype for x in inputs if x.is_floating_point()}
    if len(floating) > 1:
        return f"its floating inputs mix dtypes ({', '.join(sorted(str(d) for d in floating))})"
    if floating and next(iter(floating)) not in DTYPES:
        return f"its floating inputs are {next(iter(floating))} (stof-cc runs float16, bfloat16 and float32)"
    return None


class _CompiledGraph:
    """One dynamo graph: stof-cc's compiled module, or the fallback (with the reason). A call with
    autograd on and an input that requires grad runs the fallback too (stof-cc's kernels are for
    inference and record no graph for backward), with one warning."""

    count = 0  # graphs seen in this process, for the warnings' names

    def __init__(self, graph_module: torch.fx.GraphModule, inputs: list[Any], options: dict[str, Any]) -> None:
        self.name = f"graph {_CompiledGraph.count}"
        _CompiledGraph.count += 1
        self.graph_module, self.inputs, self.fallback = graph_module, inputs, options["fallback"]
        self._fallback_run: Callable[..., Any] | None = None
        self._warned_grad = False
        self.reason = _why_not(inputs)
        self.compiled: CompiledModule | None = None
        if self.reason is None:
            frozen = _FrozenWeights(graph_module, inputs)
            dtype = next((x.dtype for x in inputs if x.is_floating_point()), torch.float32)
            self.weight_at = set(frozen.weight_at)
            self.weights_need_grad = any(p.requires_grad for p in frozen.parameters())
            args = [x for i, x in enumerate(inputs) if i not in self.weight_at]
            try:
                self.compiled = compile_module(frozen, tuple(args), dtype=dtype, **options["compile"])
            except (TraceError, GraphError, NotImplementedError) as exc:
                self.reason = f"stof-cc could not lower it: {exc}"
        if self.compiled is None:
            warnings.warn(f"stof_cc backend: {self.name} runs on {self.fallback}, because {self.reason}",
                          stacklevel=3)
        fused = sorted({_target_name(n) for n in graph_module.graph.nodes if _target_name(n) in FUSED_LAYER_OPS})
        if fused:
            warnings.warn(f"stof_cc backend: {self.name} calls PyTorch's fused layer kernel ({', '.join(fused)}: "
                          "the inference fast path of nn.TransformerEncoderLayer / nn.MultiheadAttention), which "
                          "runs as it is; call torch.backends.mha.set_fastpath_enabled(False) before the first "
                          "call for stof-cc to fuse the layer", stacklevel=3)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            return self._run_fallback(args)
        if torch.is_grad_enabled() and (self.weights_need_grad or any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in args)):
            if not self._warned_grad:
                self._warned_grad = True
                warnings.warn(f"stof_cc backend: {self.name} runs on {self.fallback} while autograd is on "
                              "and an input requires grad; run inference under torch.no_grad() or "
                              "torch.inference_mode() for stof-cc's kernels", stacklevel=2)
            return self._run_fallback(args)
        out = self.compiled(*(x for i, x in enumerate(args) if i not in self.weight_at))
        return out if isinstance(out, (tuple, list)) else (out,)

    def _run_fallback(self, args: tuple[Any, ...]) -> Any:
        if self._fallback_run is None:
            self._fallback_run = _fallback(self.graph_module, self.inputs, self.fallback)
        return self._fallback_run(*args)


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
    options = {"fallback": fallback,
               "compile": {"mask": mask, "tune": tune, "cuda_graphs": cuda_graphs, "database": database,
                           "build_dir": build_dir}}

    def stof_cc_backend(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return _CompiledGraph(graph_module, list(example_inputs), options)

    return stof_cc_backend


stof_cc_backend = backend()  # the entry point's: torch.compile(model, backend="stof_cc")
