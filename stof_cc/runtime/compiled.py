"""`stof_cc.compile`: a lowered, partitioned model (`passes.lower`) run group by group.

Each fusion group becomes one step, in graph order:

* ``kernel``: a generated group kernel (`GroupLaunch`) writes the group's one output;
* ``attention``: the group's views run in torch, its ``rotary`` nodes in the rotary kernel
  (`backends/rotary_launch.py`), its anchor in `stof_cc.attention` (the node's own mask,
  causal, a window or none, plus key padding read on the device, or the ``mask`` given to
  `compile`);
* ``torch``: the group's nodes run through their torch references, as the interpreter does:
  groups no template covers, and every group when no GPU (or no PyCUDA) is available.

Values are dropped after their last reader, so intermediate memory follows their lifetimes
(the torch caching allocator reuses it). Kernel steps run the tuning database's winners where it
has them (``tune=True``, the default, measures those it lacks first), else the template's
default point. With ``cuda_graphs=True`` (the default) a variant is captured once and replayed
(launches off the default stream go through the driver-API launcher), which removes the host's
launch gaps (docs/decisions.md#cuda-graphs). A variant whose capture fails runs uncaptured, with
a warning. Several threads may call one compiled module: replays of a variant take turns (its
inputs are copied into one set of captured tensors), a call on another stream than the last
replay's waits for it on the GPU, and a new input shape compiles once.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

import stof_cc.templates.builtin  # noqa: F401 (registers the built-in templates before they are chosen)
from stof_cc.backends.attention_launch import KeyPadding, key_padding_on_device
from stof_cc.backends.group_launch import GroupLaunch
from stof_cc.backends.nvcc import CompileError, compile_cubin, compile_many
from stof_cc.backends.pycuda_backend import current_device, current_raw_stream, device_arch
from stof_cc.backends.rotary_launch import rotary, rotary_unsupported
from stof_cc.codegen.chain import NotFusable
from stof_cc.ir.frontend import TraceError
from stof_cc.ir.graph import Graph, GraphError, Ref
from stof_cc.ir.interpret import bind_inputs, node_runner
from stof_cc.ir.node import CONSTANT, INPUT
from stof_cc.ir.ops import pattern_kind
from stof_cc.ir.reference import empty_query_rows, fill_empty_rows, masked_attention
from stof_cc.masks import MaskDescription, MaskError, from_dense
from stof_cc.masks.replayed import CAPTURE_LOCK
from stof_cc.passes import cast_floating, lower
from stof_cc.passes.attention import added_biases, attention_arguments, is_bias
from stof_cc.passes.canonicalize import mutating_nodes
from stof_cc.passes.fusion import FusionGroup, FusionPlan
from stof_cc.passes.lower import converted_dtypes
from stof_cc.runtime import peer_exchange
from stof_cc.runtime.attention import attention
from stof_cc.runtime.build import build_groups, check_build_dir
from stof_cc.runtime.capture import capture
from stof_cc.runtime.collectives import all_reduce_in_place, in_place_all_reduces, is_collective
from stof_cc.runtime.weights import WeightWatch, eval_mode, tracing_copy, weights_to_compile
from stof_cc.templates.group import applicable_templates
from stof_cc.templates.pricing import sm_count, target_capability
from stof_cc.tune.attention import attention_kernel, node_mask
from stof_cc.tune.database import Device, TuningDatabase, check_database_argument
from stof_cc.tune.library import LIBRARY_GEMM, is_lone_linear, library_wins
from stof_cc.tune.model import group_signature, measured_times, tune_model
from stof_cc.tune.scheme import choose_scheme
from stof_cc.tune.search import SearchReport
from stof_cc.tune.tune_attention import adopt_recorded

NO_GPU = ("no GPU kernels here ({why}): every group runs in torch; `build_dir=` receives the kernels a GPU "
          "would start from (none of them runs here), and `stof-cc compile FILE.py:FACTORY --why` says what would "
          "be generated, and why not")
NO_PYCUDA = "PyCUDA is not installed: pip install 'stof-cc[gpu]'"


@dataclass
class Step:
    group: FusionGroup
    kind: str  # "kernel" | "attention" | "library" (cuBLAS, measured faster) | "torch"
    note: str
    kernel: tuple | None = None  # kernel steps: (template, problem, params)
    tuned: bool = False  # kernel steps: params are a measured winner (else stage 1's default point)
    launch: Any = None  # kernel steps: their GroupLaunch, once compiled and loaded
    mask: MaskDescription | None = None  # attention steps; torch steps of attention groups: compile's mask=
    rotary: tuple[str, ...] = ()  # attention and torch steps: the group's rotary nodes, run by the rotary kernel
    bias: tuple[str, ...] = ()  # attention steps: the values the kernel adds to the scores (float mask, ALiBi)
    empty_rows: str | None = None  # attention steps: what a query with no allowed key gives, if not 0
    swamped: torch.dtype | None = None  # attention steps: the chain's scores' dtype, where -huge added scores swamp a row
    runners: dict[tuple[str, torch.device], Any] = field(default_factory=dict)  # torch nodes' prepared evaluations
    in_place: tuple[str, ...] = ()  # torch steps: all-reduces run in place on their dying input (collectives.py)
    mirror: tuple[Any, int] | None = None  # kernel steps: (PeerExchange, slot) the GEMM also stores into (peer_exchange.py)
    # torch steps: all-reduces by peer stores, each (PeerExchange, slot, the received partial's value name where
    # a later kernel adds it, else None: added here)
    exchanged: dict[str, tuple[Any, int, str | None]] = field(default_factory=dict)
    # kernel steps that add an exchanged all-reduce's received partial as they read it: wait -> (all-reduce, received)
    adds_received: dict[str, tuple[str, str]] = field(default_factory=dict)

    def writes(self) -> set[str]:
        """The values this step leaves for later steps: a kernel its one output, any other
        step every node it runs (and the received partials that a later kernel adds)."""
        if self.kind == "kernel":
            return {self.kernel[1].output}
        return set(self.group.nodes) | {received for _, _, received in self.exchanged.values() if received}

    def reads(self, graph: Graph) -> set[str]:
        """The values this step reads: a kernel its operands (which may lie behind views the
        group's own nodes name, e.g. the merged GEMM under a `split`), any other step what its
        nodes' arguments name."""
        if self.kind == "kernel":  # one that adds a received partial stands for the all-reduced value's reader
            return {operand.ref for operand in self.kernel[1].operands} | set(self.adds_received)
        return {ref.name for name in self.group.nodes for ref in graph.node(name).refs()}


@dataclass
class Variant:
    """One input signature's graph, plan and steps."""

    graph: Graph
    plan: FusionPlan
    steps: list[Step]
    dies_after: list[list[str]] = field(default_factory=list)  # values dead after each step
    gpu: bool = False  # generated kernels run (the inputs are on a GPU with PyCUDA)
    graph_capture: tuple | None = None  # (CapturedRun, static inputs, static outputs) once captured
    capture_failed: bool = False  # the capture raised: this variant runs uncaptured
    # in-place ops kept (a buffer's ``add_``, a write into an input): never captured, whose warm-up
    # runs would write twice more and whose copied-in inputs would take the writes
    mutates: bool = False
    _constants: dict[torch.device, dict[str, torch.Tensor]] = field(default_factory=dict)
    # Calls from several threads replay the graphs one at a time: each copies its inputs into the one set
    # of static tensors and clones the static outputs, so a call interleaved with another's would read
    # the other's inputs (`CompiledModule._replayed`)
    replay_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    last_replay: tuple[int, torch.cuda.Event] | None = None  # (raw stream, event after its clones)

    def constants_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The parameters and buffers, moved to ``device`` once."""
        if device not in self._constants:
            self._constants[device] = {k: v.to(device) for k, v in self.graph.constants.items()}
        return self._constants[device]


class CompiledModule:
    """Callable like the module it was compiled from (same arguments, same output structure)."""

    def __init__(self, source: torch.nn.Module, dtype: torch.dtype, mask: MaskDescription | None,
                 use_gpu_kernels: bool, build_dir: Path | None, database: TuningDatabase | None = None,
                 tune: bool = False, cuda_graphs: bool = True) -> None:
        self.source, self.dtype, self.mask, self.cuda_graphs = source, dtype, mask, cuda_graphs
        self.use_gpu_kernels, self.build_dir = use_gpu_kernels, build_dir
        self.database, self.tune = database, tune
        self.module = weights_to_compile(source, dtype)  # the user's module itself, or a converted copy
        self._watch = WeightWatch(source)
        self._state_versions = _state_versions(self.module)
        self.variants: dict[tuple, Variant] = {}
        self._dense_masks: dict[tuple, torch.Tensor] = {}  # mask= as a bool tensor, per shape and device
        self._said_fp16 = False  # an fp32 model's attention in the fp16 kernels: said once
        self._said_training = source.training  # compile said it already (`_say_what_changes`)
        self._compile_lock = threading.RLock()  # a new input shape compiles once, whichever thread calls first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        changed = self._watch.changed()
        if changed is not None:  # never a stale answer: compile again from the module as it is now
            warnings.warn(f"stof_cc: {changed} of the compiled model changed since it was compiled (replaced, "
                          "moved, cast, written in place or hooked); compiling it again", stacklevel=2)
            self.refresh()
        if self.source.training and not self._said_training:
            self._said_training = True
            warnings.warn("stof_cc: the model was switched to training mode after it was compiled; the compiled "
                          "model still runs it for inference, as in eval mode (dropout off, running statistics)",
                          stacklevel=2)
        given, spec = pytree.tree_flatten((args, kwargs))  # once per call: the entry is host time before any kernel
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in given):
            raise ValueError("stof_cc.compile: the compiled model is inference-only (its kernels have no backward, "
                             "so the output would carry no gradient): call it under torch.no_grad() or pass "
                             "inputs that do not require grad")
        flat = cast_floating(given, self.dtype)
        cast = [(original, now) for original, now in zip(given, flat, strict=True)
                if isinstance(now, torch.Tensor) and now is not original]
        if cast:
            args, kwargs = pytree.tree_unflatten(flat, spec)
        key = _signature(flat, spec)
        with _on_device_of(flat):
            result = self._call(args, kwargs, key)
        variant = self.variants.get(key)
        if cast and (variant is None or variant.mutates):  # the model may have written into a cast input
            _written_back(cast)
        return result

    def refresh(self) -> None:
        """Read the source module's weights again and drop every compiled variant (each input
        shape compiles again on its next call; kernels and tuning records are cached). Called
        on its own when a weight changed in a way PyTorch tracks; call it yourself after a write
        through ``param.data``, which PyTorch does not track (runtime/weights.py). Under the compile
        lock: a variant another thread is compiling from the module before is not kept after it."""
        with self._compile_lock:
            self.module = weights_to_compile(self.source, self.dtype)
            self._state_versions = _state_versions(self.module)
            self.variants.clear()
            self._dense_masks.clear()
            self._watch.reset()

    def _call(self, args: tuple, kwargs: dict, key: tuple) -> Any:
        variant = self.variants.get(key)
        if variant is None:  # a new input shape: compile a variant for it (once, whichever thread asks)
            with self._compile_lock:
                variant = self.variants.get(key)
                if variant is None:
                    try:
                        variant = self.variants[key] = self._compile(args, kwargs)
                    except TraceError as exc:  # the culprit is this call's inputs, not the ones compile was given
                        raise TraceError(f"stof_cc: this call's inputs differ from those compiled for (shapes, "
                                         f"dtypes or structure), and tracing the model on them failed: {exc}") from exc
        inputs = bind_inputs(variant.graph, args, kwargs)
        with torch.no_grad():
            outputs = None
            if self.cuda_graphs and variant.gpu and not variant.capture_failed and not variant.mutates:
                try:
                    outputs = self._replayed(variant, inputs)
                except (RuntimeError, GraphError) as exc:  # e.g. a torch step that synchronises, which capture forbids
                    if isinstance(exc, GraphError) and not isinstance(exc.__cause__, RuntimeError):
                        raise  # the interpreter names the torch step that failed; anything else is not capture's
                    variant.capture_failed = True
                    warnings.warn(f"stof_cc: CUDA graph capture failed, this input shape runs uncaptured: {exc}",
                                  stacklevel=2)
            if outputs is None:
                outputs = self._execute(variant, inputs)
            if variant.mutates:
                self._kept_written_state()
        if variant.graph.out_spec is not None:
            return pytree.tree_unflatten(outputs, variant.graph.out_spec)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _kept_written_state(self) -> None:
        """After a run that wrote into buffers or parameters in place (a step counter, running statistics,
        `nn.Embedding(max_norm=)` renormalising its rows): a converted copy's written tensors copied into the
        user's module, as eager would leave them (parameters were left out: found by review), and the watch
        told that those writes were the model's own (else every call compiled again)."""
        if self.module is not self.source:
            mine, theirs = _state(self.module), _state(self.source)
            _written_back([(theirs[name], tensor) for name, tensor in mine.items() if name in self._state_versions
                           and name in theirs and tensor._version != self._state_versions[name]])
        self._watch.reset()
        self._state_versions = _state_versions(self.module)

    def _execute(self, variant: Variant, inputs: dict[str, torch.Tensor]) -> list[Any]:
        device = next((t.device for t in inputs.values()), torch.device("cpu"))
        env: dict[str, Any] = {**variant.constants_on(device), **inputs}
        for step, dead in zip(variant.steps, variant.dies_after, strict=True):
            self._run(variant.graph, step, env, device)
            for name in dead:
                env.pop(name, None)
        # an output that is a constant (folded at compile time: position ids, a mask) is a new tensor per call
        # in eager: handing out the one kept would let a caller's in-place edit reach every later call
        constants = variant.graph.constants
        return [(env[r.name].clone() if r.name in constants else env[r.name]) if isinstance(r, Ref) else r
                for r in variant.graph.outputs]

    def _replayed(self, variant: Variant, inputs: dict[str, torch.Tensor]) -> list[Any]:
        """`_replay`'s outputs, cloned, one thread at a time. A call on another stream than the last
        replay's first waits for that replay's clones (an event, no host wait): its copies into the
        static inputs would otherwise overwrite them under the other stream's graphs."""
        with variant.replay_lock:
            last = variant.last_replay
            if last is not None and last[0] != current_raw_stream(current_device()):
                torch.cuda.current_stream().wait_event(last[1])
            outputs = [o.clone() if isinstance(o, torch.Tensor) else o for o in self._replay(variant, inputs)]
            done = last[1] if last is not None else torch.cuda.Event()
            done.record()
            variant.last_replay = (current_raw_stream(current_device()), done)
        return outputs

    def _replay(self, variant: Variant, inputs: dict[str, torch.Tensor]) -> list[Any]:
        """Run the variant as CUDA graphs: captured on first use (after two warm-up runs on a
        side stream, which build every launch plan and cache), then replayed with the new inputs
        copied into the captured ones. Collectives run between graphs (runtime/capture.py says
        why). The capture runs on this device's side stream: torch.cuda.graph's default capture
        stream is one per process, made on the first device that captured, and capturing there
        switched a second device's launches to the first device (NaN on cuda:1 after cuda:0)."""
        if variant.graph_capture is None:
            with CAPTURE_LOCK:  # one capture at a time in the process (masks.replayed.CAPTURE_LOCK says why)
                static = {name: t.clone() for name, t in inputs.items()}
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._execute(variant, static)
                device = next((t.device for t in static.values()), torch.device("cuda"))
                env: dict[Any, Any] = {**variant.constants_on(device), **static}

                def run_step(index: int, values: dict[Any, Any]) -> None:
                    self._run(variant.graph, variant.steps[index], values, device)
                    for name in variant.dies_after[index]:
                        values.pop(name, None)

                exchanged = {name for step in variant.steps for name in step.exchanged}
                eager = [_outside_graphs(variant.graph, step, exchanged) for step in variant.steps]
                run = capture(eager, run_step, env, side)
                torch.cuda.current_stream().wait_stream(side)
                outputs = [env[r.name] if isinstance(r, Ref) else r for r in variant.graph.outputs]
                variant.graph_capture = (run, static, outputs)
        run, static, outputs = variant.graph_capture
        for name, tensor in inputs.items():
            static[name].copy_(tensor)
        run.replay()
        return outputs

    def explain(self) -> str:
        """Per variant (one per input signature): every group, how it runs and why."""
        lines = []
        for key, variant in self.variants.items():
            devices = sorted({entry.device for entry in key[1:] if isinstance(entry, _TensorKey)})
            inputs = ", ".join(f"%{n.name} {n.spec}" for n in variant.graph.inputs)
            lines.append(f"inputs {inputs} on {', '.join(devices) or 'no device'}:")
            if not variant.gpu and variant.steps:  # one reason for every group: said once
                lines.append(f"  {variant.steps[0].note}")
            lines += [f"  {s.group.name:<5} {s.group.kind:<11} {s.kind:<9} {'' if not variant.gpu else s.note}".rstrip()
                      for s in variant.steps]
        return "\n".join(lines)

    # -- compiling one variant ------------------------------------------------------------------
    def _compile(self, args: tuple, kwargs: dict) -> Variant:
        traced = tracing_copy(self.module)  # the user's module untouched while it is traced
        with eval_mode(traced):
            graph, plan = lower(traced, args, kwargs, dtype=self.dtype, mask=self.mask)
        if self.mask is not None:
            _check_mask_fits(graph, self.mask)
        _say_unwatched_tensors(graph, self.module)
        # kernels only for inputs on the GPU: CPU inputs on a GPU machine run through torch
        on_gpu = _on_gpu((args, kwargs))
        gpu = self.use_gpu_kernels and on_gpu
        if on_gpu and not self.use_gpu_kernels:
            _warn_once(f"stof_cc.compile: the inputs are on {_devices((args, kwargs))}, but {NO_PYCUDA}; every group "
                       "runs in torch, none in a generated kernel")
        if gpu and self.database is not None:
            if self.tune:  # chooses the scheme by the measured times of both sides of each merge
                plan, _ = tune_model(graph, plan, args, kwargs, database=self.database, mask=self.mask,
                                     progress=_report_measured)
            else:  # measured where an earlier tune recorded both sides, else estimated
                plan = choose_scheme(graph, plan, measured=measured_times(graph, self.database, Device.current()))
        else:
            plan = choose_scheme(graph, plan)
        mutating = mutating_nodes(graph)
        steps = self.steps(graph, plan, gpu, why_not=NO_PYCUDA if on_gpu else "inputs on the CPU", mutating=mutating)
        _load_kernels(steps)  # a kernel that does not compile becomes a torch step, which reads otherwise
        dies_after = _lifetimes(graph, steps)
        fresh = {step.kernel[1].output for step in steps if step.kind == "kernel"}
        for step, dying in zip(steps, dies_after, strict=True):
            step.in_place = in_place_all_reduces(graph, step.group.nodes, dying, fresh)
        if gpu and peer_exchange.all_reduce_nodes(graph):  # a tensor-parallel rank's, agreed with the other rank
            if peer_exchange.attach(graph, steps, _first_device((args, kwargs))) is not None:
                dies_after = _lifetimes(graph, steps)  # kernels that add a received partial read other values
        if self.build_dir is not None:  # what the steps run: tuned and spill-free points, the adopted attention
            build_groups(graph, plan, Path(self.build_dir) / graph.name, compile_kernels=False, mask=self.mask,
                         running=_running_kernels(steps, gpu))  # picks, the mirrored GEMMs
        return Variant(graph, plan, steps, dies_after, gpu=gpu, mutates=bool(mutating))

    def steps(self, graph: Graph, plan: FusionPlan, gpu: bool, why_not: str = "inputs on the CPU",
              mutating: list[str] | None = None) -> list[Step]:
        """One step per group of ``plan``, in order: a generated kernel, stof-cc's attention or
        torch (``gpu`` False: every step runs in torch, for the reason ``why_not``). A graph that
        kept in-place ops (writes through views, which canonicalize could not make functional) runs
        every step in torch: a kernel writes a new tensor, so the write would never land where the
        other steps read it (a buffer's ``add_``, ``t[:, :4].relu_()``: wrong answers, found by review)."""
        torch_only = None if gpu else NO_GPU.format(why=why_not)
        mutating = mutating_nodes(graph) if mutating is None else mutating
        if torch_only is None and mutating:
            torch_only = (f"in-place ops ({', '.join('%' + name for name in mutating[:3])}) write into tensors "
                          "other steps read: every group runs in torch, as the model wrote it")
        return [self._step(graph, group, torch_only) for group in plan.scheme.groups]

    def _step(self, graph: Graph, group: FusionGroup, torch_only: str | None) -> Step:
        if group.kind == "attention":
            return self._attention_step(graph, group, torch_only)
        if torch_only is not None:
            return Step(group, "torch", torch_only)
        found, refused = applicable_templates(graph, group, target_capability())
        if not found:  # its rotary nodes still run in the rotary kernel (a per-head norm's epilogue, say)
            rotary, _ = _generated_rotary(graph, group)
            note = "; ".join(refused) + (f"; {len(rotary)} rotary kernel(s)" if rotary else "")
            return Step(group, "torch", note, rotary=rotary)
        choice = self._tuned_choice(graph, group, found)
        library = self._record(LIBRARY_GEMM, graph, group) if is_lone_linear(graph, group) else None
        if choice is None:  # no point of any template was correct here: never run an unchecked default
            if library is not None:
                return Step(group, "library", f"cuBLAS through F.linear ({library.micros:.1f} us measured; no "
                                              "generated point was correct)")
            why = f"stage 2 found no correct point of {', '.join(a.template.name for a in found)} for it (tuning database)"
            warnings.warn(f"stof_cc.compile: group {group.name}: {why}; it runs in torch", stacklevel=4)
            return Step(group, "torch", why)
        template, problem, record = choice
        tuned = record is not None
        if library is not None and library_wins(library.micros, record.micros if tuned else None):
            return Step(group, "library", f"cuBLAS through F.linear ({library.micros:.1f} us measured against "
                                          + (f"{record.micros:.1f} us generated)" if tuned else "no generated record)"))
        params = record.params if tuned else template.default_params(problem)
        how = f"tuned, {record.micros:.1f} us" if tuned else "default point, not tuned"
        return Step(group, "kernel", f"{template.name} {params} ({how})", kernel=(template, problem, params),
                    tuned=tuned)

    def _attention_step(self, graph: Graph, group: FusionGroup, torch_only: str | None) -> Step:
        """stof_cc.attention for the anchor, or torch with the reason; ``mask=`` holds in both
        (in torch through the reference, `_reference_attention`): it replaces the node's own
        static or boolean mask, and a float mask (a bias) is added under it."""
        anchor = graph.node(group.anchor)
        given = attention_arguments(anchor)
        override = self.mask
        if torch_only is not None:
            return Step(group, "torch", torch_only, mask=override)
        bias = added_biases(graph, anchor)
        if given.get("attn_mask") is not None and override is None and not is_bias(graph, given["attn_mask"]):
            return Step(group, "torch", "attention with a boolean mask tensor that is not key padding "
                                        "(pass mask= to compile)")
        if override is not None and given.get("softcap") is not None:
            raise ValueError(f"stof_cc.compile: mask= cannot replace the mask of %{anchor.name}: its scores are "
                             "softcapped, which only the model's own attention computes")
        try:
            kernel = attention_kernel(graph, anchor, mask=override)
        except NotFusable as why:  # the model's meaning is kept; its speed is not stof-cc's
            warnings.warn(f"stof_cc.compile: attention {why}; it runs in torch", stacklevel=4)
            return Step(group, "torch", str(why), mask=override)
        if self.database is not None and not kernel.problem.bias:  # stage 2 tunes attention without a bias
            failed = adopt_recorded(kernel.problem, kernel.mask, self.database)
            if failed is not None:
                warnings.warn(f"stof_cc.compile: no attention kernel matched torch for %{anchor.name} when "
                              f"measured ({failed}); it runs in torch", stacklevel=4)
                return Step(group, "torch", f"stage 2 found no correct attention kernel for it ({failed})",
                            mask=override)
        rotary, why_not = _generated_rotary(graph, group)
        added = " and ".join(f"%{r.name}" for r in bias)
        note = "stof_cc.attention for the anchor" + (f", adding {added} to the scores" if bias else "") \
            + (", with each head's sink in its softmax" if given.get("sinks") is not None else "") \
            + (" under mask=" if bias and self.mask is not None else "") \
            + (f", {len(rotary)} rotary kernel(s)" if rotary else "") \
            + "".join(f", %{name} in torch ({why})" for name, why in why_not.items()) + ", views in torch"
        # a query whose keys are all padding gets what the model's own attention gave it (the
        # kernels write 0); under mask= the mask is the user's, and such a query gets 0
        empty_rows = given.get("empty_rows") if override is None and given.get("key_padding") is not None else None
        if empty_rows == "unmasked":  # a second launch that runs every call: explain() names it (found by review)
            note += (", and a second launch with no mask for the rows whose every key is padding (the model's finite "
                     "fill gives them the unmasked attention)")
        elif empty_rows is not None:
            note += f", the rows whose every key is padding given the model's {empty_rows}"
        if self.dtype not in (torch.float16, torch.bfloat16):  # `_attention` converts: say so, once per model
            note += f", in fp16 (the kernels' dtype; the model runs in {self.dtype})"
            if not self._said_fp16:
                self._said_fp16 = True
                warnings.warn(f"stof_cc.compile: the model runs in {self.dtype}; its attention runs in the fp16 kernels "
                              "(q, k and v converted, the output converted back: about 1e-3 of relative rounding, "
                              "and values beyond fp16's 65504 overflow; "
                              "an added bias is rounded to fp16 too, by up to 0.25 where it reaches 1000, as "
                              "ALiBi's does at long range). "
                              "Pass dtype=torch.float16 or torch.bfloat16 to run the whole model in the kernels' "
                              "dtype", stacklevel=4)
        # a hand-written chain adding a finite -huge mask to scores it holds in `scores_dtype` (fp16 in eager
        # Llama): a row masked everywhere rounds to one value, so eager gives it the mean of V; the fp32
        # kernels keep the scores' differences and gave it the unmasked attention (found by review)
        swamped = given.get("scores_dtype") if override is None and given.get("key_padding") is None and bias else None
        return Step(group, "attention", note, mask=node_mask(given, override), rotary=rotary,
                    bias=tuple(r.name for r in bias), empty_rows=empty_rows, swamped=swamped)

    def _tuned_choice(self, graph: Graph, group: FusionGroup, found: list) -> tuple[Any, Any, Any] | None:
        """(template, problem, record) of the fastest template that stage 2 recorded for ``group``
        with parameters still legal, as the search itself picked it (each template keeps its own
        fastest record); else the first template not recorded as failed (its default point); None
        when every template is (`Record.failed`: no point of it matched torch). The first
        template alone would be a user's whenever one applies, though a built-in measured faster
        or the user's failed the check against torch (found by review). The record's parameters are
        the space's own point: a record's 128.0 equals 128 but would render as a double."""
        records = [(a, self._record(a.template, graph, group)) for a in found]
        recorded = [(a.template, a.problem, replace(record, params=a.space[a.space.index(record.params)]))
                    for a, record in records if record is not None and not record.failed and record.params in a.space]
        if recorded:
            return min(recorded, key=lambda choice: choice[2].micros)
        untried = [a for a, record in records if record is None or not record.failed]
        return (untried[0].template, untried[0].problem, None) if untried else None

    def _record(self, template, graph: Graph, group: FusionGroup):
        """The tuning database's record of ``template`` (or `LIBRARY_GEMM`) for ``group``, or None.
        A kernel step runs a record's parameters where they are still a legal point, else the
        template's default point."""
        if self.database is None:
            return None
        return self.database.lookup(template, group_signature(graph, group), Device.current())

    # -- running ----------------------------------------------------------------------------------
    def _run(self, graph: Graph, step: Step, env: dict[str, Any], device: torch.device) -> None:
        if step.kind == "kernel":
            problem = step.kernel[1]
            if step.mirror is None:
                env[problem.output] = step.launch(env)  # the problem's output: found once, at compile
            else:  # a GEMM before an all-reduce by peer stores also stores its output into the peer's slot
                exchange, slot = step.mirror
                env[problem.output] = step.launch(env, exchange.peer_slot(slot, problem.shape, problem.dtype))
            return
        for name in step.group.nodes:
            if step.kind == "attention" and name == step.group.anchor:
                env[name] = self._attention(graph.node(name), env, step)
                continue
            if name in step.rotary:
                env[name] = rotary(*(env[r.name] for r in graph.node(name).args))
                continue
            if name in step.exchanged:  # its GEMM stored this rank's partial into the peer's slot too
                exchange, slot, received = step.exchanged[name]
                value = env[graph.node(name).args[0].name]
                if received is None:
                    env[name] = exchange.finish(slot, value)
                else:  # the kernel that reads the value adds the received partial (peer_exchange.consumer_adding)
                    env[received], env[name] = exchange.received(slot, value), value
                continue
            if name in step.in_place:
                env[name] = all_reduce_in_place(graph, name, env)
                continue
            if step.kind == "torch" and step.mask is not None and name == step.group.anchor:  # mask= in torch
                env[name] = self._reference_attention(graph.node(name), env)
                continue
            if (name, device) not in step.runners:  # prepared once per device, then reused every call
                step.runners[name, device] = node_runner(graph, graph.node(name), device)
            env[name] = step.runners[name, device](env)

    def _attention(self, node, env: dict[str, Any], step: Step) -> torch.Tensor:
        given = attention_arguments(node)
        q, k, v = (env[given[n].name] for n in ("query", "key", "value"))
        dtype = q.dtype
        if dtype not in (torch.float16, torch.bfloat16):  # the kernels are fp16/bf16: an fp32 model gets fp16
            q, k, v = (t.half() for t in (q, k, v))
        b, h, s, d = q.shape
        out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)  # SDPA's layout
        bias = _summed([env[name] for name in step.bias])
        sinks = env[given["sinks"].name] if given.get("sinks") is not None else None
        out = attention(q, k, v, step.mask, given.get("scale"), key_padding=_key_padding(given, env), bias=bias,
                        out=out, sinks=sinks)
        if step.empty_rows is not None:
            empty = empty_query_rows(env[given["key_padding"].name] != 0, s, bool(given.get("is_causal")),
                                     given.get("window"))
            unmasked = None if step.empty_rows != "unmasked" else attention(q, k, v, None, given.get("scale"))
            out = fill_empty_rows(out, v, empty, step.empty_rows, unmasked)
        if step.swamped is not None:  # every added score at most half the sum's lowest: eager's sum swamps the row
            lowest = torch.finfo(torch.promote_types(step.swamped, bias.dtype)).min
            out = fill_empty_rows(out, v, (bias <= lowest / 2).all(-1, keepdim=True), "mean")
        return out.to(dtype)

    def _reference_attention(self, node, env: dict[str, Any]) -> torch.Tensor:
        """An attention node run in torch under ``compile(mask=...)``: the mask replaces the
        node's own static or boolean mask and keeps its bias, as on the kernel path, and a row
        with no allowed key gives 0 there too."""
        given = attention_arguments(node)
        q, k, v = (env[given[n].name] for n in ("query", "key", "value"))
        key = (tuple(q.shape), k.shape[-2], q.device)
        if key not in self._dense_masks:
            self._dense_masks[key] = self.mask.to_dense(q.shape[-2], k.shape[-2], q.shape[0],
                                                        q.shape[1]).to(q.device)
        dense = self._dense_masks[key]
        if given.get("key_padding") is not None:  # the model's padding holds under mask= as well
            dense = dense & (env[given["key_padding"].name] != 0)[:, None, None, :]
        bias = _summed([env[r.name] for r in (given.get("attn_mask"), given.get("bias"))
                        if isinstance(r, Ref) and env[r.name].is_floating_point()])
        sinks = env[given["sinks"].name] if given.get("sinks") is not None else None  # they hold under mask= too
        return masked_attention(q, k, v, dense, given.get("scale"), bias=bias, sinks=sinks)


def compile(model: torch.nn.Module, example_inputs: tuple[Any, ...] | torch.Tensor,  # noqa: A001
            example_kwargs: dict[str, Any] | None = None, *, mask: MaskDescription | None = None,
            dtype: torch.dtype = torch.float16, build_dir: str | Path | None = None, tune: bool = True,
            database: TuningDatabase | str | Path | None = None, cuda_graphs: bool = True) -> CompiledModule:
    """Compile ``model`` for inputs shaped like ``example_inputs`` / ``example_kwargs`` (more
    shapes compile on first use). The model and floating inputs run in ``dtype`` (with float32 the
    attention still runs in the fp16 kernels, said once with a warning); ``mask``
    replaces the masks of the model's attention nodes; ``build_dir`` receives each group's `.cu`: the
    kernel it runs (a tuned winner, an attention pick adopted from the database; none for the library GEMM;
    with inputs on the CPU, where every group runs in torch, the kernels a GPU would start from).
    Group kernels run the tuning database's winners where it has them (``database``: a
    `TuningDatabase` or its path; default the user's); ``tune`` (the default) first measures, on
    the GPU, every group the database has no record for (`stof-cc tune` does the same from the
    shell; what a cold and a warm compile cost: docs/decisions.md#tuning-in-compile), and
    ``tune=False`` reads the database and otherwise takes stage 1's picks.
    ``cuda_graphs`` (default on) replays each input shape as one CUDA graph (key padding too:
    the kernels read it on the device; a failed capture warns and runs uncaptured). ``mask``
    replaces a node's own static mask (causal, window, a boolean tensor), never its key padding.
    The compiled module reads ``model``'s weights (shared when already in ``dtype``) and compiles
    again when they change (runtime/weights.py says what it notices)."""
    check_switches("stof_cc.compile", tune=tune, cuda_graphs=cuda_graphs)  # "no" is true (found by review)
    mask = _check_compile_arguments(model, example_inputs, example_kwargs, mask, dtype, build_dir, database)
    _say_what_changes(model, dtype, (example_inputs, example_kwargs))
    gpu = _gpu_kernels_available()
    if gpu and not isinstance(database, TuningDatabase):
        database = TuningDatabase(database)
    compiled = CompiledModule(model, dtype, mask, gpu, Path(build_dir) if build_dir else None,
                              database if gpu else None, tune, cuda_graphs)
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    args, kwargs = cast_floating((args, dict(example_kwargs or {})), dtype)
    flat, spec = pytree.tree_flatten((args, kwargs))
    with _on_device_of(flat):
        compiled.variants[_signature(flat, spec)] = compiled._compile(args, kwargs)  # the example's, now
    return compiled


def check_switches(where: str, **switches: Any) -> None:
    """Each of ``switches`` True or False: a string such as "no" is true, and would turn on what it
    asked to turn off."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be True or False, got {value!r}")


def _check_compile_arguments(model: Any, example_inputs: Any, example_kwargs: Any, mask: Any,
                             dtype: Any, build_dir: Any, database: Any) -> MaskDescription | None:
    """`compile`'s arguments checked up front, each error naming the argument (``build_dir`` and
    ``database`` too, which are otherwise used only later, or never where no GPU runs); a bool
    tensor mask becomes its `from_dense` description."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"stof_cc.compile: model must be a torch.nn.Module, got {type(model).__name__} "
                        "(wrap a function in a torch.nn.Module)")
    if not isinstance(example_inputs, (torch.Tensor, tuple, list)):
        raise TypeError(f"stof_cc.compile: example_inputs must be a tensor or a tuple of the model's "
                        f"positional arguments, got {type(example_inputs).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"stof_cc.compile: example_kwargs must be a dict or None, got "
                        f"{type(example_kwargs).__name__}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"stof_cc.compile: dtype must be torch.float16, torch.bfloat16 or torch.float32, "
                        f"got {dtype!r}")
    check_build_dir(build_dir, "stof_cc.compile: build_dir")
    check_database_argument(database, "stof_cc.compile: database")
    if isinstance(mask, torch.Tensor):
        return from_dense(mask)
    if mask is not None and not isinstance(mask, MaskDescription):
        raise TypeError(f"stof_cc.compile: mask must be a stof_cc.masks description, a bool tensor or "
                        f"None, got {type(mask).__name__}")
    return mask


def _say_what_changes(model: torch.nn.Module, dtype: torch.dtype, example: Any) -> None:
    """One warning each when the compiled model will not run as the model does now: weights in
    another floating dtype (it runs in ``dtype``), floating inputs in another dtype where no weight
    says so (a model without floating weights: its inputs and outputs change dtype), or training
    mode (it is compiled for inference: dropout off)."""
    others = converted_dtypes(model, dtype)
    inputs = sorted({str(t.dtype) for t in pytree.tree_leaves(example)
                     if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype})
    if others:
        warnings.warn(f"stof_cc.compile: the model's weights are {', '.join(others)}; the compiled model runs in "
                      f"{dtype} (a converted copy of them): pass dtype= to choose", stacklevel=3)
    elif inputs:
        warnings.warn(f"stof_cc.compile: the example inputs are {', '.join(inputs)}; the compiled model casts "
                      f"floating inputs to {dtype} and returns {dtype}: pass dtype= to choose", stacklevel=3)
    if model.training:
        warnings.warn("stof_cc.compile: the model is in training mode; it is compiled for inference, as in eval "
                      "mode (dropout off)", stacklevel=3)


def _report_measured(item: Any) -> None:
    """compile's tuning progress on stderr: two lines per group it measured (what, how long, the
    winner); groups the database answered, and tune_model's other notes, stay quiet, so a warm
    compile prints nothing."""
    if isinstance(item, SearchReport) and not item.from_database:
        print("stof_cc.compile: tuned " + "\n   ".join(str(item).splitlines()[:2]), file=sys.stderr, flush=True)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by qualified name."""
    return dict(module.named_parameters()) | dict(module.named_buffers())


def _state_versions(module: torch.nn.Module) -> dict[str, int]:
    """Each parameter's and buffer's version counter: which ones a run wrote in place (`_kept_written_state`)."""
    return {name: tensor._version for name, tensor in _state(module).items() if not tensor.is_inference()}


def _written_back(cast: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The elements a run wrote into cast copies (of the caller's inputs, of the model's parameters and
    buffers), written into the originals: found by comparing each copy with its original cast again (an
    inference tensor has no version counter to say whether it was written: under `torch.inference_mode()`
    reading one raised, found by review), and only those elements (copying the whole copy back rounded every
    element of an fp32 cache, or of an embedding table, that the model never wrote: found by review)."""
    with torch.no_grad():
        for original, now in cast:
            written = now != original.to(now.dtype)
            if written.any():
                original[written] = now[written].to(original.dtype)


def _gpu_kernels_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import pycuda  # noqa: F401
    except ImportError:
        return False
    return True


def _signature(flat: list[Any], spec: Any) -> tuple:
    """A call's variant key from its flattened arguments: structure, and each tensor's shape,
    strides, dtype and device (cuda:0 and cuda:1 are different variants; so are a tensor and its
    transpose made contiguous, since the trace fixes a forward's branch on ``is_contiguous()`` or
    ``stride()``: one was run for the other, found by review)."""
    return (str(spec),) + tuple(_TensorKey(tuple(t.shape), t.stride(), t.dtype, str(t.device))
                                if isinstance(t, torch.Tensor) else repr(t) for t in flat)


class _TensorKey(NamedTuple):
    """A tensor argument's part of a variant key (`_signature`)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str


def _check_mask_fits(graph: Graph, mask: MaskDescription) -> None:
    """``compile(mask=)`` against every attention node's sizes, at compile time: a mask of other
    sizes (or a mask_mod that returns no bool) would otherwise fail only at the first call."""
    for node in graph.nodes():
        if pattern_kind(node.op) != "attention":
            continue
        given = attention_arguments(node)
        q, k = (graph.node(given[name].name).spec.shape for name in ("query", "key"))
        if len(q) != 4:  # [B, H, S, D], as the kernels and the torch path read the mask's dims
            continue
        batch, heads = q[0], q[1]
        try:
            mask.mask_dims(q[-2], k[-2], batch, heads)
        except MaskError as exc:  # MaskTypeError too: a mask_mod that returns no bool
            raise type(exc)(f"stof_cc.compile: mask= does not fit attention node %{node.name} (batch {batch}, "
                            f"{heads} heads, {q[-2]} queries, {k[-2]} keys): {exc}") from exc


def _on_gpu(tree: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in pytree.tree_leaves(tree))


def _first_device(tree: Any) -> torch.device:
    """The first CUDA tensor's device, else the first tensor's."""
    tensors = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return next((t.device for t in tensors if t.is_cuda), tensors[0].device)


def _devices(tree: Any) -> str:
    return ", ".join(sorted({str(t.device) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)}))


_warned: set[str] = set()


def _say_unwatched_tensors(graph: Graph, module: torch.nn.Module) -> None:
    """Warn where the forward read tensors the weight watch cannot see: torch.export names them
    ``lifted_tensor_N`` (a global, a closure's, another object's attribute). Tensors in a
    submodule's dict, list or tuple attribute are lifted too, but watched (runtime/weights.py)."""
    watched = {t.data_ptr() for t in WeightWatch(module).watched()}
    outside = [graph.node(name).spec for name, tensor in graph.constants.items()
               if str(graph.node(name).target).startswith("lifted_tensor") and tensor.data_ptr() not in watched]
    if outside:
        _warn_once(f"stof_cc.compile: the forward reads {len(outside)} tensor(s) held outside the model's parameters, "
                   f"buffers and attributes ({', '.join(str(spec) for spec in outside[:4])}: a global, a closure's "
                   "or another object's), which its weight watch cannot see: after replacing or changing one, call "
                   "refresh(), or make it a buffer or attribute of a submodule")


def _warn_once(message: str) -> None:
    """A warning said once per process (every compiled module of a model would repeat it)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def _on_device_of(flat: list[Any]) -> contextlib.AbstractContextManager:
    """The first CUDA input's device made current (kernels load, launch and capture on the current
    device: a model on cuda:1 runs there), or nothing for CPU inputs or an already current one."""
    device = next((t.device for t in flat if isinstance(t, torch.Tensor) and t.is_cuda), None)
    if device is None or device.index == current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _running_kernels(steps: list[Step], gpu: bool) -> dict[str, tuple | str]:
    """Per group name, the kernel its step runs (one that did not compile too: its source is what to
    read), or why no generated kernel runs (the library GEMM; with kernels on, torch: stage 2 found no
    correct point, so the default would be the very kernel it rejected); attention steps are left to the
    build's own choice (the adopted pick). Without kernels (CPU inputs) every group keeps the build's
    choice: what a GPU would start from."""
    running: dict[str, tuple | str] = {}
    for step in steps:
        if step.kernel is not None:
            running[step.group.name] = step.kernel
        elif step.kind == "library" or (gpu and step.kind == "torch"):
            running[step.group.name] = f"{step.kind}: {step.note}"
    return running


def _outside_graphs(graph: Graph, step: Step, exchanged: set[str]) -> bool:
    """Whether ``step`` runs between the CUDA graphs: it holds a collective that NCCL runs. The
    variant's all-reduces by peer stores (``exchanged``), and the waits on their values (a step of
    their own in a tensor-parallel plan: found by review), run inside them."""
    for name in step.group.nodes:
        node = graph.node(name)
        if not is_collective(node) or name in exchanged:
            continue
        if "wait_tensor" in str(node.target) and isinstance(node.args[0], Ref) and node.args[0].name in exchanged:
            continue
        return True
    return False


def _load_kernels(steps: list[Step]) -> None:
    """Compile every kernel step's source in parallel (one nvcc process each), then load them.
    A kernel that does not compile turns its step into a torch step that says why, with a
    warning: the model still runs, the failure is not hidden."""
    pending = [s for s in steps if s.kind == "kernel"]
    if not pending:
        return
    arch = device_arch()
    errors = compile_many([(t.render(p, params), arch + t.arch_features) for t, p, params in (s.kernel for s in pending)])
    for step, error in zip(pending, errors, strict=True):
        if error:
            step.kind, step.note = "torch", f"{step.note} did not compile, torch runs it: {error.splitlines()[0]}"
            warnings.warn(f"stof_cc: group {step.group.name}: {step.note}", stacklevel=3)
            continue
        if not step.tuned:
            step.kernel, why = spill_free_point(*step.kernel, arch)
            step.note += why
        step.launch = GroupLaunch(*step.kernel)


def spill_free_point(template, problem, params: dict[str, Any], arch: str) -> tuple[tuple, str]:
    """(template, problem, point) to run instead of a default ``params`` whose compiled kernel
    spills registers (ptxas's report): the best-estimated point that does not, and a note saying
    so. Stage 1 estimates cannot see register pressure from a long epilogue (a norm, then two
    activations); the compiler's report can. A measured (tuned) point is kept as it is."""
    if not _spill_bytes(template, problem, params, arch):
        return (template, problem, params), ""
    others = sorted((q for q in template.space(problem) if q != params),
                    key=lambda q: template.estimate(problem, q, sm_count()))
    for other in others:
        try:
            if not _spill_bytes(template, problem, other, arch):
                return (template, problem, other), f"; the default point spills registers, so {other}"
        except CompileError:
            continue
    return (template, problem, params), "; every point spills registers"


def _spill_bytes(template, problem, params: dict[str, Any], arch: str) -> int:
    compiled = compile_cubin(template.render(problem, params), arch=arch + template.arch_features)
    report = compiled.resources.get(template.kernel_name(problem, params))
    return report.spill_stores if report is not None else 0


def _generated_rotary(graph: Graph, group: FusionGroup) -> tuple[tuple[str, ...], dict[str, str]]:
    """The group's rotary nodes the rotary kernel runs, and why the others stay in torch."""
    generated, refused = [], {}
    for name in group.nodes:
        node = graph.node(name)
        if node.op != "rotary":
            continue
        why = rotary_unsupported(graph.node(node.args[0].name).spec, graph.node(node.args[1].name).spec)
        if why is None:
            generated.append(name)
        else:
            refused[name] = why
    return tuple(generated), refused


def _summed(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The sum of an attention node's added terms (a float mask and ALiBi: one add, per call), or None."""
    if not tensors:
        return None
    return tensors[0] if len(tensors) == 1 else tensors[0] + tensors[1]


def _key_padding(given: dict[str, Any], env: dict[str, Any]) -> KeyPadding | None:
    """The attention node's key padding as the kernels read it, converted on the device once per
    call (every layer of a model reads the same ``attention_mask``) and kept in ``env``."""
    source = given.get("key_padding")
    if source is None:
        return None
    slot = ("key padding on the device", source.name)
    if slot not in env:
        env[slot] = key_padding_on_device(env[source.name])
    return env[slot]


def _lifetimes(graph: Graph, steps: list[Step]) -> list[list[str]]:
    """For each step, the values no later step reads (graph outputs live to the end). Raises
    if a step reads a value no earlier step wrote: a scheduling error of stof-cc's, named here
    at compile time rather than as a missing input at the first call."""
    last: dict[str, int] = {}
    written = {n.name for n in graph.nodes() if n.op in (INPUT, CONSTANT)}
    for index, step in enumerate(steps):
        reads = step.reads(graph)
        missing = sorted(reads - written - set(step.group.nodes))
        if missing:
            raise RuntimeError(f"stof_cc internal error: step {index} (group {step.group.name}, {step.kind}) "
                               f"reads %{', %'.join(missing)} before any step writes it")
        for name in reads:
            last[name] = index
        written |= step.writes()
    outputs = {r.name for r in graph.outputs if isinstance(r, Ref)}
    dies: list[list[str]] = [[] for _ in steps]
    for name, index in last.items():
        if name not in outputs:
            dies[index].append(name)
    return dies
