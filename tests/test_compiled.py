"""stof_cc.compile: the whole compile path on the CPU (every group through torch there), and on
the GPU the generated kernels against eager."""

from __future__ import annotations

import copy
import re
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch

import stof_cc
from stof_cc.ir.frontend import trace
from stof_cc.ir.graph import GraphError
from stof_cc.ir.reference import masked_attention, relative_error
from stof_cc.loading import load_factory

EXAMPLES = ("tiny_bert", "gpt2_block", "encoder_layer")


@pytest.mark.parametrize("example", EXAMPLES)
def test_compiled_module_equals_eager_on_the_cpu(example, example_path, tmp_path):
    module, args, kwargs = load_factory(example_path(example))
    compiled = stof_cc.compile(module, args, kwargs, dtype=torch.float32, build_dir=tmp_path)
    with torch.no_grad():
        want = module(*args, **kwargs)
    got = compiled(*args, **kwargs)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    explained = compiled.explain()
    assert "torch" in explained and "no GPU kernels here" in explained  # honest about the CPU path
    assert explained.startswith("inputs %") and "TreeSpec" not in explained  # input shapes, not pytree specs
    assert list((tmp_path).rglob("*.cu"))  # the generated sources are written all the same


def test_inputs_on_a_gpu_without_pycuda_are_said_once_and_named_in_explain(monkeypatch):
    """A GPU machine without PyCUDA (make's .venv, `pip install -e .`) runs every group in torch:
    compile says so once, naming the missing extra, and explain says it once, not per group.
    (No GPU here: the inputs are taken for CUDA ones.)"""
    import stof_cc.runtime.compiled as compiled_module

    monkeypatch.setattr(compiled_module, "_on_gpu", lambda tree: True)
    monkeypatch.setattr(compiled_module, "_warned", set())
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16)).eval()
    with pytest.warns(UserWarning, match=r"PyCUDA is not installed: pip install 'stof-cc\[gpu\]'; every group runs"):
        first = stof_cc.compile(model, (torch.randn(2, 16),))
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        stof_cc.compile(model, (torch.randn(2, 16),))
    assert not [w for w in again if "PyCUDA" in str(w.message)]  # said once per process
    explained = first.explain()
    assert explained.count("PyCUDA is not installed") == 1 and re.search(r"\n  g0 +gemm +torch\n", explained)


def test_a_mask_that_does_not_fit_is_refused_by_compile_not_by_the_first_call(example_path):
    """compile(mask=) of other sizes, for another batch, or a mask_mod returning no bool: the error
    comes from compile, naming the attention node and its sizes (it came at the first call)."""
    from stof_cc import masks

    module, args, kwargs = load_factory(example_path("gpt2_block"))
    wrong = [(torch.ones(100, 100, dtype=torch.bool), "the mask is 100 x 100"),
             (masks.key_padding([10, 20, 30]), "3 lengths given"),
             (masks.from_mask_mod(lambda b, h, q, k: q - k), "returned dtype torch.int64")]
    for mask, says in wrong:
        with pytest.raises(masks.MaskError, match=r"stof_cc.compile: mask= does not fit attention node %\w+ "
                                                  r"\(batch 2, 4 heads, 64 queries, 64 keys\): .*" + re.escape(says)):
            stof_cc.compile(module, args, kwargs, mask=mask)


def test_a_second_shape_compiles_a_second_variant(example_path):
    module, (x, mask), _ = load_factory(example_path("encoder_layer"))
    compiled = stof_cc.compile(module, (x, mask), dtype=torch.float32)
    shorter = (x[:1], mask)
    torch.testing.assert_close(compiled(*shorter), module(*shorter).detach(), rtol=1e-5, atol=1e-5)
    assert len(compiled.variants) == 2


def test_an_input_of_another_layout_compiles_its_own_variant():
    """The trace fixes a branch on ``is_contiguous()``: a transposed input of the same shape ran the
    contiguous input's variant, x * 2 where eager gives x * 3 (found by review)."""
    class ByLayout(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.is_contiguous() else x * 3

    x = torch.randn(8, 8)
    compiled = stof_cc.compile(ByLayout(), (x,), dtype=torch.float32, tune=False)
    transposed = x.T.contiguous().T
    torch.testing.assert_close(compiled(transposed), transposed * 3)
    torch.testing.assert_close(compiled(x), x * 2)
    assert len(compiled.variants) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("example", ["gpt2_block", "encoder_layer"])
def test_compiled_module_matches_eager_on_the_gpu(example, example_path):
    module, args, _ = load_factory(example_path(example))
    module = module.cuda().half()
    args = tuple(a.cuda().half() if a.is_floating_point() else a.cuda() for a in args)
    compiled = stof_cc.compile(module, args)
    with torch.no_grad():
        want = module(*args)
    got = compiled(*args)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert relative_error(g, w) < 1e-2
    assert "kernel" in compiled.explain() or "attention" in compiled.explain()


def test_mask_override_on_the_sparse_bert_example(example_path):
    from stof_cc.masks.workloads import grid_mask

    module, (x, dense), _ = load_factory(example_path("sparse_bert"))
    compiled = stof_cc.compile(module, (x, dense), mask=grid_mask("sliding", x.shape[1]), dtype=torch.float32)
    torch.testing.assert_close(compiled(x, dense), module(x, dense).detach(), rtol=1e-4, atol=1e-4)


class FakeLaunch:
    """Stands in for a group kernel on the CPU: checks that every operand the kernel would read is
    there, then computes the group's output with the torch references."""

    launched: list[str] = []

    def __init__(self, template, problem, params) -> None:
        self.template, self.problem = template, problem

    def __call__(self, values):
        from stof_cc.ir.interpret import evaluate_node

        missing = [op.ref for op in self.problem.operands if op.ref not in values]
        assert not missing, f"{self.template.name} would read {missing}, which the runtime did not provide"
        # as a kernel does: its operands only read (copies here), its output a new tensor
        env = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in values.items()}
        for name in self.problem.group.nodes:
            env[name] = evaluate_node(self.problem.graph, self.problem.graph.node(name), env, torch.device("cpu"))
        FakeLaunch.launched.append(self.template.name)
        return env[self.problem.output].clone()


def _fake_attention(q, k, v, mask=None, scale=None, *, key_padding=None, bias=None, out=None, sinks=None):
    _fake_attention.paddings.append(key_padding)
    dense = None if mask is None else mask.to_dense(q.shape[-2], k.shape[-2], batch=q.shape[0], heads=q.shape[1])
    if key_padding is not None:  # the kernels' reading of KeyPadding: keys in [start, end) that are valid
        keys = torch.arange(k.shape[-2])
        start, end, _ = key_padding.ranges.unbind(1)
        kept = (keys >= start[:, None]) & (keys < end[:, None]) & key_padding.valid.bool()
        kept = kept[:, None, None, :]
        dense = kept if dense is None else dense & kept
    if bias is not None or sinks is not None:  # the kernels add it to the fp32 scores; the sinks count in the softmax
        result = masked_attention(q, k, v, dense, scale, bias=bias, sinks=sinks)
    else:
        result = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
    return result if out is None else out.copy_(result)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """The GPU path on the CPU: kernels compile with nvcc for sm_90 as on an H100, and fakes
    stand in for loading and launching them (CPU tensors play the GPU's)."""
    import stof_cc.backends.group_launch
    import stof_cc.runtime.attention
    import stof_cc.runtime.compiled
    from stof_cc.tune.database import Device

    monkeypatch.setenv("STOF_CC_TUNING_DB", str(tmp_path / "t.sqlite"))
    monkeypatch.setattr(stof_cc.runtime.compiled, "_gpu_kernels_available", lambda: True)
    monkeypatch.setattr(stof_cc.runtime.compiled, "_on_gpu", lambda tree: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(Device, "current", staticmethod(lambda: Device("fake H100", (9, 0), "13.0")))
    monkeypatch.setattr(stof_cc.runtime.compiled, "GroupLaunch", FakeLaunch)
    monkeypatch.setattr(stof_cc.runtime.compiled, "attention", _fake_attention)
    FakeLaunch.launched = []
    _fake_attention.paddings = []
    return monkeypatch


@pytest.mark.nvcc
def test_the_gpu_path_plumbing_with_fake_kernels(fake_gpu, example_path):
    """Everything of the GPU path but running the kernels: step selection, compilation, value
    flow into and out of kernel steps, key padding as device data, lifetimes."""
    import stof_cc.runtime.compiled

    module, args, kwargs = load_factory(example_path("tiny_bert"))
    compiled = stof_cc.compile(module, args, kwargs, dtype=torch.float32, tune=False,  # nothing to measure on
                               cuda_graphs=False)
    with torch.no_grad():
        want = module(*args, **kwargs).last_hidden_state
    got = compiled(*args, **kwargs).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    explained = compiled.explain()
    assert "row_reduce" in explained and "default point, not tuned" in explained
    assert explained.count(" attention ") >= 2  # both layers' attention through stof_cc.attention (key padding)
    assert "row_reduce" in FakeLaunch.launched
    # key padding reaches the kernel as device data, converted once per call for all layers
    paddings = _fake_attention.paddings
    assert len(paddings) == 2 and paddings[0] is paddings[1] and paddings[0].ranges.dtype == torch.int32


@pytest.mark.nvcc
def test_the_build_folder_holds_what_the_steps_run(fake_gpu, tmp_path):
    """`compile(build_dir=)` wrote each group's default point before the steps were chosen: a tuned
    winner ran while its file showed the default (found by review with the dilated window's fix).
    Now each kernel step's file holds the point it runs, and a group the library GEMM runs has no file.
    Nothing is measured: the records are stand-ins."""
    import dataclasses

    import stof_cc.runtime.compiled
    from stof_cc.runtime.compiled import CompiledModule

    chosen = CompiledModule._tuned_choice

    def tuned_elsewhere(self, graph, group, found):  # every group "tuned" to a point other than its default
        template, problem, record = chosen(self, graph, group, found)
        default = template.default_params(problem)
        params = next((p for p in template.space(problem) if p != default), default)
        return template, problem, dataclasses.replace(record, params=params) if record else SimpleNamespace(
            params=params, micros=1.0)

    def library_records(self, template, graph, group):  # cuBLAS recorded faster for every lone linear
        return SimpleNamespace(micros=0.5) if template is stof_cc.runtime.compiled.LIBRARY_GEMM else None

    fake_gpu.setattr(CompiledModule, "_tuned_choice", tuned_elsewhere)
    fake_gpu.setattr(CompiledModule, "_record", library_records)
    fake_gpu.setattr(stof_cc.runtime.compiled, "spill_free_point", lambda *kernel: (kernel[:3], ""))
    module = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                 torch.nn.Linear(512, 256)).eval()  # a GEMM + GELU, a norm, a lone linear
    compiled = stof_cc.compile(module, (torch.randn(4, 128, 256),), dtype=torch.float16, tune=False,
                               cuda_graphs=False, build_dir=tmp_path)
    (variant,) = compiled.variants.values()
    kernels = [step for step in variant.steps if step.kind == "kernel"]
    library = [step for step in variant.steps if step.kind == "library"]
    assert kernels and library
    for step in library:
        assert not (tmp_path / variant.graph.name / f"{step.group.name}.cu").exists()
    for step in kernels:
        template, problem, params = step.kernel
        assert params != template.default_params(problem) or len(template.space(problem)) == 1
        source = (tmp_path / variant.graph.name / f"{step.group.name}.cu").read_text()
        assert f"// parameters: {', '.join(f'{k}={v}' for k, v in sorted(params.items()))}\n" in source
        assert template.kernel_name(problem, params) in source


@pytest.mark.nvcc
def test_the_build_folder_has_no_kernel_that_stage_2_rejected(fake_gpu, example_path, tmp_path):
    """Groups whose every point stage 2 recorded as wrong run in torch: the build folder held the very
    kernels it rejected, the default points (found by review). Now they have no file; the CPU path
    still writes every group's start point (test_compiled_module_equals_eager_on_the_cpu)."""
    import stof_cc.runtime.compiled as compiled_module

    fake_gpu.setattr(compiled_module.CompiledModule, "_tuned_choice", lambda self, graph, group, found: None)
    fake_gpu.setattr(compiled_module, "adopt_recorded", lambda problem, mask, database: "attention_wgmma_ws: off by 0.5")
    module, args, kwargs = load_factory(example_path("tiny_bert"))
    with pytest.warns(UserWarning, match="stage 2 found no correct"):
        compiled = stof_cc.compile(module, args, kwargs, dtype=torch.float16, tune=False, cuda_graphs=False,
                                   build_dir=tmp_path)
    (variant,) = compiled.variants.values()
    rejected = [step for step in variant.steps if step.kind == "torch" and "stage 2" in step.note]
    assert {step.group.kind for step in rejected} >= {"attention", "gemm"}
    for step in rejected:
        assert not (tmp_path / variant.graph.name / f"{step.group.name}.cu").exists(), step.group.name


def test_explain_names_the_second_launch_for_rows_whose_keys_are_all_padding(fake_gpu):
    """A finite fill (T5 in fp16) gives a row whose every key is padding the unmasked attention: the compiled
    model launches a second, unmasked attention for those rows every call, which explain() did not say
    (found by review)."""
    from test_key_padding import ModelsOwnTest

    q, k, v = (torch.randn(3, 2, 128, 64) for _ in range(3))
    padding = torch.tensor([[1] * 128, [1] * 100 + [0] * 28, [0] * 128])
    compiled = stof_cc.compile(ModelsOwnTest("!= 0", "shifting").eval(), (q, k, v, padding), dtype=torch.float16,
                               tune=False, cuda_graphs=False)
    assert "a second launch with no mask for the rows whose every key is padding" in compiled.explain()


def test_cuda_graphs_flag_is_harmless_without_a_gpu(example_path):
    module, args, _ = load_factory(example_path("gpt2_block"))
    compiled = stof_cc.compile(module, args, dtype=torch.float32, cuda_graphs=True)
    torch.testing.assert_close(compiled(*args), module(*args).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_the_plain_path(half_on_gpu):
    module, args = half_on_gpu("gpt2_block")
    plain = stof_cc.compile(module, args, cuda_graphs=False)
    graphed = stof_cc.compile(module, args, cuda_graphs=True)
    for _ in range(2):  # the second call replays with new inputs copied in
        fresh = tuple(torch.randn_like(a) for a in args)
        want = plain(*fresh)
        got = graphed(*fresh)
        assert relative_error(got, want) < 1e-3
    assert all(v.graph_capture is not None for v in graphed.variants.values())


class _PausesItsTrace(torch.nn.Module):
    """A linear whose trace at two rows waits, mid-forward, until told to go on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.tracing, self.go = threading.Event(), threading.Event()

    def forward(self, x):
        if x.shape[0] == 2 and torch.compiler.is_exporting():
            self.tracing.set()
            self.go.wait(60)
        return self.fc(x)


def test_the_users_module_is_untouched_while_a_new_shape_is_traced():
    """torch.export swaps fake tensors into the module it traces: while one thread compiled a new
    shape, another thread's call saw every weight changed (spurious recompiles; with a buffer the
    model writes, errors on fake tensors) and the user's own eager calls met fake tensors (found by
    review). The trace now runs on a copy holding the same tensors."""
    torch.manual_seed(0)
    model = _PausesItsTrace().eval()
    one, two = torch.randn(1, 16), torch.randn(2, 16)
    compiled = stof_cc.compile(model, (one,), dtype=torch.float32, tune=False)
    result = {}
    tracer = threading.Thread(target=lambda: result.setdefault("two", compiled(two)))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracer.start()
        try:
            assert model.tracing.wait(60)
            assert type(model.fc.weight) is torch.nn.Parameter  # not a fake tensor
            torch.testing.assert_close(compiled(one), model(one))
        finally:
            model.go.set()
            tracer.join()
        torch.testing.assert_close(result["two"], model(two))
    assert not [w for w in caught if "changed since it was compiled" in str(w.message)]
    assert len(compiled.variants) == 2


def test_a_module_whose_pickled_state_drops_attributes_is_traced_whole():
    """The trace's copy of the module structure takes each module's attributes as they are, not
    through ``__getstate__`` (which may leave out what pickling should not carry)."""
    class Unpickled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.scale = torch.nn.Linear(8, 8), 3.0

        def __getstate__(self):
            return {k: v for k, v in self.__dict__.items() if k != "scale"}

        def forward(self, x):
            return self.fc(x) * self.scale

    model, x = Unpickled().eval(), torch.randn(2, 8)
    torch.testing.assert_close(stof_cc.compile(model, (x,), dtype=torch.float32)(x), model(x))


@pytest.mark.gpu
def test_threads_calling_one_compiled_module_each_get_their_own_answer(half_on_gpu):
    """Every call copies its inputs into the captured graphs' one set of static tensors: two threads
    interleaving there would each read the other's inputs. Calls take turns (a lock), a thread on its
    own stream first waits for the last replay's clones (an event), and a shape two threads call
    first at once is captured once, one capture at a time in the process (a capture's device-wide
    synchronisation invalidates another in flight)."""
    import threading

    module, args = half_on_gpu("gpt2_block")
    compiled = stof_cc.compile(module, args, tune=False, cuda_graphs=True)
    compiled(*args)  # this shape captured before the threads start; the shorter one in them
    shorter = tuple(a[:, : a.shape[1] // 2].contiguous() for a in args)
    failures: list[str] = []
    compared = []

    def calls(tag: int, own_stream: bool) -> None:
        try:
            stream = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
            with torch.cuda.stream(stream), torch.no_grad():
                for i in range(15):
                    fresh = tuple(torch.randn_like(a) * (1 + tag) for a in (args if i % 3 else shorter))
                    got, want = compiled(*fresh), module(*fresh)
                    torch.cuda.current_stream().synchronize()
                    error = relative_error(got, want)
                    compared.append(error)
                    if not error < 1e-2:
                        failures.append(f"thread {tag} call {i}: relative error {error:.2e}")
        except Exception as exc:  # noqa: BLE001 - a thread's exception would only be printed
            failures.append(f"thread {tag}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=calls, args=(tag, tag % 2 == 1)) for tag in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]
    assert len(compared) == 60 and len(compiled.variants) == 2
    assert all(v.graph_capture is not None and not v.capture_failed for v in compiled.variants.values())


@pytest.mark.gpu
def test_a_process_whose_first_kernel_runs_in_a_worker_thread_ends_cleanly():
    """PyCUDA imported first in a worker thread left its context on that thread's stack, and PyCUDA
    aborted the process when the thread ended ("The context stack was not empty upon module
    cleanup"; found when a test that starts a thread ran first in its process)."""
    import subprocess
    import sys

    script = (
        "import threading, torch, stof_cc\n"
        "from stof_cc import masks\n"
        "from stof_cc.ir.reference import masked_attention, relative_error\n"
        "mask, errors = masks.sliding_window(48), []\n"
        "def run():\n"
        "    q, k, v = (torch.randn(2, 3, 328, 64, device='cuda', dtype=torch.float16) for _ in range(3))\n"
        "    want = masked_attention(q, k, v, mask.to_dense(328, 328).cuda())\n"
        "    errors.append(relative_error(stof_cc.attention(q, k, v, mask), want))\n"
        "worker = threading.Thread(target=run)\n"
        "worker.start(); worker.join()\n"
        "run()\n"  # and the main thread after it
        "assert len(errors) == 2 and max(errors) < 1e-2, errors\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.gpu
def test_a_thread_other_than_pycudas_loads_and_launches_kernels():
    """PyCUDA's context sits on the stack of the thread that imported it: a kernel first loaded, or
    launched on the default stream, from another thread goes through the driver API (a `mma.sync`
    point, which PyCUDA launches on its own thread, and the warp-specialised one)."""
    import threading

    from stof_cc import masks
    from stof_cc.ir.reference import masked_attention

    mask = masks.sliding_window(48)
    results: list[object] = []

    def run() -> None:
        try:
            for params in ({"strategy": "blockwise", "block_m": 64, "block_n": 64, "warps": 4, "m_tiles": 1,
                            "stages": 2}, None):
                q, k, v = (torch.randn(2, 3, 328, 64, device="cuda", dtype=torch.float16) for _ in range(3))
                out = stof_cc.attention(q, k, v, mask, params=params)
                results.append(relative_error(out, masked_attention(q, k, v, mask.to_dense(328, 328).cuda())))
        except Exception as exc:  # noqa: BLE001 - a thread's exception would only be printed
            results.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert len(results) == 2 and all(isinstance(e, float) and e < 1e-2 for e in results), results


@pytest.mark.gpu
def test_on_the_gpu_in_place_writes_run_once_and_misaligned_inputs_are_read(half_on_gpu):
    """Found by review on an H100: a buffer's add_ ran in the capture's warm-up too (3, 6, 9 where eager
    gives 1, 2, 3), and a contiguous input at an address that is not 16-byte aligned raised without
    CUDA graphs (the graphs' static copy hid it)."""
    eager, source = _CountingBuffer().cuda().half().eval(), _CountingBuffer().cuda().half().eval()
    x = torch.randn(2, 4, device="cuda", dtype=torch.float16)
    compiled = stof_cc.compile(source, (x,), tune=False, cuda_graphs=True)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), eager(x))
    module, (x,) = half_on_gpu("gpt2_block")
    compiled = stof_cc.compile(module, (x,), tune=False, cuda_graphs=False)
    buffer = torch.randn(x.numel() + 1, device="cuda", dtype=torch.float16)
    odd = buffer[1:].view(x.shape)  # contiguous, 2 bytes past an aligned address
    assert odd.data_ptr() % 16
    assert relative_error(compiled(odd), module(odd)) < 1e-2


@pytest.mark.nvcc
def test_mask_override_reaches_stof_attention_on_the_gpu_path(fake_gpu, example_path):
    import stof_cc.runtime.compiled
    from stof_cc.masks.workloads import grid_mask

    monkeypatch = fake_gpu
    module, (x, dense), _ = load_factory(example_path("sparse_bert"))
    compiled = stof_cc.compile(module, (x, dense), mask=grid_mask("sliding", x.shape[1]), dtype=torch.float32,
                               cuda_graphs=False, tune=False)
    torch.testing.assert_close(compiled(x, dense), module(x, dense).detach(), rtol=1e-4, atol=1e-4)
    import re

    assert len(re.findall(r"attention\s+attention", compiled.explain())) == 2  # replaced mask, not torch steps

    # with CUDA graphs (the default), a capture that fails warns once and the shape runs uncaptured
    def failing_capture(self, variant, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(stof_cc.runtime.compiled.CompiledModule, "_replay", failing_capture)
    graphed = stof_cc.compile(module, (x, dense), mask=grid_mask("sliding", x.shape[1]), dtype=torch.float32,
                              tune=False)
    with pytest.warns(UserWarning, match="capture failed, this input shape runs uncaptured: operation not permitted"):
        first = graphed(x, dense)
    torch.testing.assert_close(first, module(x, dense).detach(), rtol=1e-4, atol=1e-4)
    assert all(v.capture_failed for v in graphed.variants.values())
    torch.testing.assert_close(graphed(x, dense), first)  # no second attempt (and no second warning)

    # a torch step that reads the host fails inside the interpreter, which names the node: the same fallback
    # (transformers' grouped_mm_fallback copies expert offsets to the host; GPT-OSS in fp16 raised here)
    def failing_step(self, variant, inputs):
        try:
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
        except RuntimeError as exc:
            raise GraphError("node %grouped_mm_fallback (opaque) failed: Cannot copy ...") from exc

    monkeypatch.setattr(stof_cc.runtime.compiled.CompiledModule, "_replay", failing_step)
    graphed = stof_cc.compile(module, (x, dense), mask=grid_mask("sliding", x.shape[1]), dtype=torch.float32,
                              tune=False)
    with pytest.warns(UserWarning, match="capture failed, this input shape runs uncaptured: node %grouped_mm"):
        torch.testing.assert_close(graphed(x, dense), first)

    def broken_graph(self, variant, inputs):  # not a failure of torch's: it reaches the caller
        raise GraphError("node %x is malformed")

    monkeypatch.setattr(stof_cc.runtime.compiled.CompiledModule, "_replay", broken_graph)
    graphed = stof_cc.compile(module, (x, dense), mask=grid_mask("sliding", x.shape[1]), dtype=torch.float32,
                              tune=False)
    with pytest.raises(GraphError, match="malformed"):
        graphed(x, dense)


def test_a_kernel_that_does_not_compile_falls_back_to_torch_and_says_so(fake_gpu, example_path):
    import stof_cc.runtime.compiled

    def first_fails(jobs, workers=None):
        return ["kernel.cu(12): error: identifier \"oops\" is undefined"] + [""] * (len(jobs) - 1)

    fake_gpu.setattr(stof_cc.runtime.compiled, "compile_many", first_fails)
    module, args, _ = load_factory(example_path("gpt2_block"))
    with pytest.warns(UserWarning, match=r"group g0: .* did not compile, torch runs it: kernel.cu\(12\)"):
        compiled = stof_cc.compile(module, args, dtype=torch.float32, cuda_graphs=False, tune=False)
    # (the fake attention is SDPA, eager's is GPT-2's matmul chain: fp32 rounding apart)
    torch.testing.assert_close(compiled(*args), module(*args).detach(), rtol=1e-3, atol=1e-3)
    (variant,) = compiled.variants.values()
    assert variant.steps[0].kind == "torch" and "did not compile" in variant.steps[0].note
    assert any(step.kind == "kernel" for step in variant.steps)



class _RmsNormThenGelus(torch.nn.Module):
    """A long epilogue after the norm: at 128 x 256 tiles ptxas spills (found in review)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(768, 768)
        self.norm = torch.nn.RMSNorm(768)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(torch.nn.functional.gelu(self.norm(self.fc(x)))) * 2.0


@pytest.mark.nvcc
def test_a_point_that_spills_registers_gives_way_to_one_that_does_not(norm_merges_win):
    from stof_cc.passes import canonicalize, partition
    from stof_cc.runtime.compiled import _spill_bytes, spill_free_point
    from stof_cc.templates.gemm_layernorm import GEMM_LAYERNORM
    from stof_cc.templates.pricing import H100
    from stof_cc.tune.scheme import choose_scheme

    x = torch.randn(4000, 768, dtype=torch.float16)
    graph = canonicalize(trace(_RmsNormThenGelus().half(), (x,), {}))
    (group,) = [g for g in choose_scheme(graph, partition(graph), H100).scheme.groups if g.kind == "gemm"]
    problem = GEMM_LAYERNORM.match(graph, group)
    # outside the space (its register rule drops it), like a default whose estimate missed a long epilogue
    default = {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 4}
    assert default not in GEMM_LAYERNORM.space(problem)
    assert _spill_bytes(GEMM_LAYERNORM, problem, default, "sm_90") > 0  # the premise
    (_, _, chosen), note = spill_free_point(GEMM_LAYERNORM, problem, default, "sm_90")
    assert chosen != default and chosen in GEMM_LAYERNORM.space(problem)
    assert _spill_bytes(GEMM_LAYERNORM, problem, chosen, "sm_90") == 0
    assert "the default point spills registers" in note


@pytest.mark.nvcc
def test_compile_takes_a_merge_the_tuning_database_measured_faster(fake_gpu, example_path):
    """Stage 2 over schemes, as compile sees it: where the database holds measured winners for a
    merged GEMM + LayerNorm group and for both groups it replaces, the merge follows them."""
    from stof_cc.codegen import NotFusable
    from stof_cc.passes import lower
    from stof_cc.templates.group import group_templates
    from stof_cc.tune.database import Device, TuningDatabase
    from stof_cc.tune.model import group_signature

    module, args, kwargs = load_factory(example_path("encoder_layer"))
    graph, plan = lower(copy.deepcopy(module).eval(), args, kwargs, dtype=torch.float16)
    database, device = TuningDatabase(), Device.current()

    def record(group, micros):
        for template in group_templates(group.kind):
            try:
                problem = template.match(graph, group)
            except NotFusable:
                continue
            database.store(template, group_signature(graph, group), device, template.default_params(problem), micros)
            return
        raise AssertionError(f"no template for {group}")

    assert "gemm_layernorm" not in stof_cc.compile(module, args, kwargs, tune=False).explain()  # estimated: kept apart
    for _, alternative in plan.alternatives:
        record(next(g for g in alternative.groups if g not in plan.default.groups), 1.0)
        for group in plan.default.groups:
            if group not in alternative.groups:
                record(group, 10.0)
    explained = stof_cc.compile(module, args, kwargs, tune=False).explain()  # the records decide, nothing measured
    assert explained.count("gemm_layernorm") == 2 and explained.count("(tuned, 1.0 us)") == 2


def test_compile_reports_the_groups_it_tuned_and_stays_quiet_on_database_hits(capsys):
    """compile(tune=True)'s progress: a measured group prints its counts and winner on stderr;
    a group answered by the tuning database prints nothing (a warm compile is silent)."""
    from stof_cc.runtime.compiled import _report_measured
    from stof_cc.templates.gemm_epilogue import GEMM_EPILOGUE
    from stof_cc.tune.search import Candidate, SearchReport

    winner = Candidate(GEMM_EPILOGUE, {"block_m": 128}, 10.0, "")
    measured = SearchReport("gemm linear -> f16[4,8]", 27, 19, 8, 3.5, winner, 9.5, 2)
    remembered = SearchReport("gemm linear -> f16[4,8]", 27, 27, 0, 0.01, winner, 9.5, 1, from_database=True)
    _report_measured(remembered)
    _report_measured("g3: not tuned (a note)")
    assert capsys.readouterr().err == ""
    _report_measured(measured)
    err = capsys.readouterr().err
    assert err.startswith("stof_cc.compile: tuned gemm linear -> f16[4,8]: 27 candidates")
    assert "8 measured" in err and "winner gemm_epilogue {'block_m': 128}: 9.5 us, rank 2" in err


class _SDPA(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_mask_override_holds_where_attention_runs_in_torch():
    """compile(mask=...) on the torch path (the CPU): the mask the kernels would apply, not
    the model's own (no mask here); a row with no allowed key gives 0 as on the kernel path."""
    from stof_cc import masks

    q, k, v = (torch.randn(2, 4, 96, 32) for _ in range(3))
    causal = stof_cc.compile(_SDPA(), (q, k, v), mask=masks.causal(), dtype=torch.float32)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(causal(q, k, v), want, rtol=1e-5, atol=1e-5)
    padded = stof_cc.compile(_SDPA(), (q, k, v), mask=masks.key_padding([96, 0]), dtype=torch.float32)
    out = padded(q, k, v)
    torch.testing.assert_close(out[0], torch.nn.functional.scaled_dot_product_attention(q, k, v)[0],
                               rtol=1e-5, atol=1e-5)
    assert not out[1].any()  # batch 1 attends no key


def test_mask_override_that_changes_nothing_warns():
    from stof_cc import masks

    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match="has no attention node: the mask changes nothing"):
        stof_cc.compile(torch.nn.Linear(8, 8), (x,), mask=masks.causal(), dtype=torch.float32)


@pytest.mark.parametrize(("change", "message"), [
    ({"model": lambda x: x}, "model must be a torch.nn.Module, got function"),
    ({"example_inputs": None}, "example_inputs must be a tensor or a tuple"),
    ({"example_kwargs": [1]}, "example_kwargs must be a dict or None, got list"),
    ({"mask": "not a mask"}, "mask must be a stof_cc.masks description, a bool tensor or None, got str"),
    ({"dtype": "float16"}, "dtype must be torch.float16, torch.bfloat16 or torch.float32"),
])
def test_compile_names_a_bad_argument(change, message):
    q = torch.randn(1, 1, 16, 32)
    arguments = {"model": _SDPA(), "example_inputs": (q, q, q)} | change
    with pytest.raises(TypeError, match=message):
        stof_cc.compile(arguments.pop("model"), arguments.pop("example_inputs"), **arguments)


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"database": 12345}, TypeError, "stof_cc.compile: database must be a TuningDatabase, a file path or None, got int"),
    ({"database": "{folder}"}, "TuningDatabaseError", "stof_cc.compile: database {folder} is a directory; give a "
                                                      "file path"),
    ({"database": "{file}/t.sqlite"}, "TuningDatabaseError", "stof_cc.compile: database {file}/t.sqlite: {file} is "
                                                             "a file, not a folder"),
    ({"build_dir": 3}, TypeError, "stof_cc.compile: build_dir must be a folder path or None, got int"),
    ({"build_dir": "{file}"}, ValueError, "stof_cc.compile: build_dir {file} is a file, not a folder"),
    ({"build_dir": "{file}/bd"}, ValueError, "stof_cc.compile: build_dir {file}/bd: {file} is a file, not a folder"),
], ids=["database-int", "database-folder", "database-under-file", "build_dir-int", "build_dir-file",
        "build_dir-under-file"])
def test_compile_checks_database_and_build_dir_up_front(change, error, message, tmp_path):
    """Before the fix these passed silently where no GPU runs (database: it is never opened) or
    ended in a raw NotADirectoryError (build_dir) (issue 32, items 9 and 10)."""
    from stof_cc.tune.database import TuningDatabaseError

    (tmp_path / "notes.txt").write_text("mine")
    names = {"folder": tmp_path, "file": tmp_path / "notes.txt"}
    change = {k: v.format(**names) if isinstance(v, str) else v for k, v in change.items()}
    error = TuningDatabaseError if error == "TuningDatabaseError" else error
    q = torch.randn(1, 1, 16, 32)
    with pytest.raises(error, match=re.escape(message.format(**names))):
        stof_cc.compile(_SDPA(), (q, q, q), dtype=torch.float32, **change)
    assert sorted(tmp_path.iterdir()) == [tmp_path / "notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"


def _named_model(name: str) -> torch.nn.Module:
    """A linear layer and a ReLU (one generated group) in a class called ``name``."""
    def init(self):
        torch.nn.Module.__init__(self)
        self.lin = torch.nn.Linear(64, 64)

    return type(name, (torch.nn.Module,), {"__init__": init, "forward": lambda self, x: torch.relu(self.lin(x))})()


@pytest.mark.parametrize("name", ["../../../escaped", "x" * 300, "/abs", "..", "a b:c*?<>\\"],
                         ids=["parents", "300-characters", "absolute", "dot-dot", "odd-characters"])
def test_a_model_name_never_leads_outside_the_build_dir(name, tmp_path):
    """A class named ``../../../escaped`` wrote its .cu files beside the build folder's parents;
    one of 300 characters ended in OSError errno 36 (issue 32, item 5)."""
    build = tmp_path / "x" / "y" / "bd"
    stof_cc.compile(_named_model(name).eval(), (torch.randn(16, 64),), build_dir=build)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.is_relative_to(build) for p in written), written
    (folder,) = build.iterdir()
    assert len(folder.name.encode()) <= 96 and not folder.name.startswith(".")


@pytest.mark.nvcc
def test_stof_cc_tune_records_what_compile_looks_up(fake_gpu, example_path):
    """`stof-cc tune` and `stof_cc.compile` lower the same way (one `lower`, one dtype), so every
    record compile looks up is one the tune command measures (they once drifted: tune skipped
    the fp16 cast and tuned fp32 signatures that compile never looked up)."""
    import stof_cc.cli
    from stof_cc.tune.database import TuningDatabase
    from stof_cc.tune.model import group_signature, groups_to_tune

    monkeypatch = fake_gpu
    tuned: set[str] = set()

    def record_groups(graph, plan, *args, **kwargs):
        tuned.update(group_signature(graph, g) for g in groups_to_tune(graph, plan, (9, 0)))
        return plan, []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a fake H100 (fake_gpu: sm_90)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(stof_cc.cli, "tune_model", record_groups)
    assert stof_cc.cli.main(["tune", example_path("encoder_layer")]) == 0

    looked_up: list[str] = []
    lookup = TuningDatabase.lookup
    monkeypatch.setattr(TuningDatabase, "lookup",
                        lambda self, template, signature, device: looked_up.append(signature) or lookup(
                            self, template, signature, device))
    module, args, kwargs = load_factory(example_path("encoder_layer"))
    stof_cc.compile(module, args, kwargs, tune=False)  # the default dtype, fp16
    assert looked_up and set(looked_up) <= tuned


class _Biased(torch.nn.Module):
    """Attention with an additive position bias (a float mask), as T5 and ALiBi models have."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.randn(1, 2, 8, 8))

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


def test_mask_override_and_a_bias_both_hold():
    """compile(mask=causal) on attention with a float bias: the causal mask restricts the keys
    and the bias is still added (it was dropped before: the output was the bias alone)."""
    from stof_cc import masks

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    module = _Biased().eval()
    compiled = stof_cc.compile(module, (q, k, v), mask=masks.causal(), dtype=torch.float32)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    want = masked_attention(q, k, v, causal, bias=module.bias)
    torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_padding_values_and_fully_padded_rows_mean_what_they_mean_in_the_model(attention, example_path):
    """BERT's padding test is ``attention_mask.bool()`` (2 and -1 are tokens) and a sequence that
    is all padding gets what the model's attention gives it (eager: the mean of V, HF's finfo.min
    mask; sdpa on the CPU: 0): the compiled model answers the same."""
    module, args, kwargs = load_factory(example_path("tiny_bert"))
    module.config._attn_implementation = attention
    compiled = stof_cc.compile(module, args, kwargs, dtype=torch.float32)
    for mask in ([[1] * 32, [0] * 32], [[2] * 16 + [-1] * 16, [1] * 8 + [0] * 24]):
        mask = torch.tensor(mask)
        with torch.no_grad():
            want = module(*args, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(compiled(*args, attention_mask=mask).last_hidden_state, want,
                                   rtol=1e-5, atol=1e-5)


def test_an_fp32_models_attention_in_the_fp16_kernels_is_said_once():
    """A newcomer's review: dtype=torch.float32 ran the attention in fp16 without a word. The step's
    note says so, and one warning per compiled model."""
    from stof_cc.passes import lower
    from stof_cc.runtime.compiled import CompiledModule

    class Attending(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(1, 2, 128, 64)
    graph, plan = lower(Attending(), (q, q, q))
    module = CompiledModule(Attending(), torch.float32, None, use_gpu_kernels=False, build_dir=None)
    with pytest.warns(UserWarning, match="runs in torch.float32; its attention runs in the fp16 kernels") as caught:
        steps = module.steps(graph, plan, gpu=True)
        module.steps(graph, plan, gpu=True)
    assert len([w for w in caught if "fp16 kernels" in str(w.message)]) == 1
    assert any(s.kind == "attention" and "in fp16" in s.note for s in steps)
    half = CompiledModule(Attending(), torch.float16, None, use_gpu_kernels=False, build_dir=None)
    assert not any("in fp16" in s.note for s in half.steps(graph, plan, gpu=True))


class _CountingBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(4))

    def forward(self, x):
        self.calls.add_(1)
        return x + self.calls


class _WriteThroughView(torch.nn.Module):
    def forward(self, x):
        t = x * 1.0
        r = t[:, :4].relu_()
        return t + 1, r * 2


@pytest.mark.nvcc
@pytest.mark.parametrize("module", [_CountingBuffer(), _WriteThroughView()], ids=["buffer add_", "relu_ on a view"])
def test_in_place_writes_land_on_the_gpu_path(fake_gpu, module):
    """A graph that keeps in-place ops runs every step in torch (a kernel writes a new tensor, so a
    buffer's add_ or a view's relu_ would be lost), and says so."""
    import copy

    x = torch.randn(2, 4)
    eager, compiled_from = copy.deepcopy(module), copy.deepcopy(module)
    compiled = stof_cc.compile(compiled_from, (x,), dtype=torch.float32, tune=False, cuda_graphs=False)
    for _ in range(3):
        torch.testing.assert_close(compiled(x.clone()), eager(x.clone()))
    assert "in-place ops" in compiled.explain()


class _WritesItsCache(torch.nn.Module):
    def forward(self, cache, x):
        cache[:, :2].copy_(x)
        return cache * 2


def _no_capture(*args, **kwargs):
    raise AssertionError("a variant with in-place ops was captured")


@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["shared weights", "converted copy"])
def test_in_place_writes_are_never_captured_and_land_where_eager_puts_them(fake_gpu, dtype):
    """With CUDA graphs on, a buffer's add_ ran twice more in the capture's warm-up (3, 6, 9 where eager
    gives 1, 2, 3 on an H100: found by review), every call compiled again (the model's own write looked
    like the user's), a converted copy's buffer advanced but not the user's, and a write into an input
    landed in the static copy the graph reads. Such a variant now runs uncaptured on the caller's tensors."""
    import copy

    fake_gpu.setattr(stof_cc.runtime.compiled.CompiledModule, "_replay", _no_capture)
    eager, source = _CountingBuffer().eval(), _CountingBuffer().eval()
    compiled = stof_cc.compile(source, (torch.randn(2, 4),), dtype=dtype, tune=False, cuda_graphs=True)
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "changed since it was compiled": no compile per call
        for _ in range(3):
            torch.testing.assert_close(compiled(x).float(), eager(x), atol=1e-2, rtol=1e-2)
    assert torch.equal(source.calls, eager.calls)  # the user's module as eager leaves it

    cache, x = torch.zeros(2, 4), torch.randn(2, 2)
    compiled = stof_cc.compile(_WritesItsCache().eval(), (cache, x), dtype=dtype, tune=False, cuda_graphs=True)
    want = copy.deepcopy(cache)
    _WritesItsCache()(want, x)
    compiled(cache, x)  # fp32 into a compile for fp16: the write goes to the cast input, then back
    torch.testing.assert_close(cache, want, atol=1e-3, rtol=1e-3)


def test_inputs_that_require_grad_are_refused_not_detached():
    """The compiled model runs under no_grad: an input that requires grad got an output without a
    gradient, silently (found by review); stof_cc.attention already refused it."""
    module = torch.nn.Linear(4, 4).eval()
    compiled = stof_cc.compile(module, (torch.randn(2, 4),), dtype=torch.float32, tune=False)
    with pytest.raises(ValueError, match="inference-only"):
        compiled(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        torch.testing.assert_close(compiled(torch.randn(2, 4, requires_grad=True) * 0 + 1), module(torch.ones(2, 4)))


def test_hooks_changed_after_compile_compile_again_and_training_mode_is_said():
    """A forward hook added or removed after compile was ignored (up to 10.5 off eager), and so was
    train() (found by review): a hook change compiles again; training mode warns once."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()).eval()
    x = torch.randn(2, 4)
    compiled = stof_cc.compile(module, (x,), dtype=torch.float32, tune=False)
    handle = module[0].register_forward_hook(lambda m, args, out: out * 3)
    with pytest.warns(UserWarning, match="forward hooks of '0'"):
        got = compiled(x)
    torch.testing.assert_close(got, module(x))
    handle.remove()
    with pytest.warns(UserWarning, match="forward hooks"):
        got = compiled(x)
    torch.testing.assert_close(got, module(x))
    module.train()
    with pytest.warns(UserWarning, match="switched to training mode"):
        compiled(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(x)  # said once


class _Scaled(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scale)


@pytest.mark.nvcc
@pytest.mark.parametrize("scale", [-0.125, 1e-31])
def test_attention_with_a_scale_the_kernels_do_not_take_runs_in_torch(fake_gpu, scale):
    """The kernels take a positive scale of at least 1e-30: a negative one became a kernel step that raised
    at its first call on the GPU (found by review); it is NotFusable now, and torch runs it."""
    q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
    compiled = stof_cc.compile(_Scaled(scale).eval(), (q, k, v), dtype=torch.float32, tune=False, cuda_graphs=False)
    (variant,) = compiled.variants.values()
    assert [s.kind for s in variant.steps if s.group.kind == "attention"] == ["torch"]
    assert f"scale {scale}" in compiled.explain()
    torch.testing.assert_close(compiled(q, k, v), _Scaled(scale)(q, k, v))


class _AdditivePadding(torch.nn.Module):
    """Attention written out in the model's dtype with HF's additive padding mask, (1 - mask) * min."""

    def forward(self, q, k, v, padding):
        scores = q @ k.transpose(-1, -2) * 0.125
        scores = scores + (1.0 - padding[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
        return torch.softmax(scores, -1) @ v


@pytest.mark.nvcc
def test_a_row_padded_everywhere_gets_eagers_answer_on_the_gpu_path(fake_gpu):
    """fp16 scores plus a finite -65504 everywhere round to one value: eager gives that row the mean
    of V, which the fp32 kernels would not (they gave the unmasked attention: found by review)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 64) for _ in range(3))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0] = 0  # the first sequence is padding everywhere
    padding[1, 9:] = 0
    module = _AdditivePadding()
    compiled = stof_cc.compile(module, (q, k, v, padding), dtype=torch.float16, tune=False, cuda_graphs=False)
    args = (q.half(), k.half(), v.half(), padding)
    with torch.no_grad():
        want = module(*args)
    torch.testing.assert_close(compiled(*args), want, rtol=2e-2, atol=2e-2)


class _UpcastPadding(torch.nn.Module):
    """fp16 q and k upcast, the fp16 padding mask added to the fp32 scores (GPT-J's chain): the sum keeps
    the scores' differences, so a row padded everywhere is the unmasked attention, not the mean of V."""

    def forward(self, q, k, v, padding):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * 0.125
        scores = scores + (1.0 - padding[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
        return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v)


@pytest.mark.nvcc
def test_a_row_padded_everywhere_over_fp32_scores_keeps_their_differences(fake_gpu):
    """The step filled that row with the mean of V by fp16's swamping (the upcasts dropped, the node said
    its scores were fp16; found by review)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 64, dtype=torch.float16) for _ in range(3))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0] = 0
    padding[1, 9:] = 0
    module = _UpcastPadding()
    compiled = stof_cc.compile(module, (q, k, v, padding), dtype=torch.float16, tune=False, cuda_graphs=False)
    with torch.no_grad():
        want = module(q, k, v, padding)
    assert (want[0] - v[0].float().mean(1, keepdim=True).half()).abs().max() > 0.1  # not the mean of V
    torch.testing.assert_close(compiled(q, k, v, padding), want, rtol=2e-2, atol=2e-2)


class _TakesAFlag(torch.nn.Module):
    def forward(self, x, causal=None):
        return x * 2


def test_a_call_whose_inputs_cannot_be_traced_names_the_call_not_the_examples():
    """A later call with a non-tensor argument said "example input kwargs['causal']", blaming the
    inputs given to compile (found by a newcomer's read)."""
    from stof_cc.ir.frontend import TraceError

    compiled = stof_cc.compile(_TakesAFlag().eval(), (torch.randn(2, 4),), dtype=torch.float32, tune=False)
    with pytest.raises(TraceError, match=r"this call's inputs differ .* input kwargs\['causal'\] is a bool"):
        compiled(torch.randn(2, 4), causal=True)


def test_an_input_to_cast_under_inference_mode_runs():
    """The README's inference_mode: reading the cast copy's version counter raised (an inference tensor has
    none: found by review)."""
    lin = torch.nn.Linear(4, 4).eval()
    compiled = stof_cc.compile(lin, (torch.randn(2, 4),), dtype=torch.float16, tune=False)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        got = compiled(x)
    torch.testing.assert_close(got.float(), lin.half()(x.half()).float(), rtol=1e-3, atol=1e-3)


class _Shift(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", None)

    def forward(self, x):
        return x * 2 if self.shift is None else x * 2 + self.shift


@pytest.mark.parametrize("change", ["a bias set where there was None", "a buffer set where there was None",
                                    "a layer appended"])
def test_weights_and_layers_added_after_compile_compile_again(change):
    """The watch saw only the tensors there at compile time: a bias set on Linear(bias=False), a None buffer
    set, a layer appended ran the old model silently (found by review)."""
    x = torch.randn(2, 4)
    model = _Shift().eval() if "buffer" in change else \
        torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.ReLU()).eval()
    compiled = stof_cc.compile(model, (x,), dtype=torch.float32, tune=False)
    if "bias" in change:
        model[0].bias = torch.nn.Parameter(torch.full((4,), 10.0))
    elif "buffer" in change:
        model.shift = torch.full((4,), 100.0)
    else:
        model.append(torch.nn.Linear(4, 2))
    with torch.no_grad():
        want = model(x)
    with pytest.warns(UserWarning, match="compiling it again"):
        torch.testing.assert_close(compiled(x), want)


def test_a_parameter_the_forward_writes_reaches_the_users_module_where_written():
    """nn.Embedding(max_norm=) renormalises the rows it reads in place: under a converted copy the user's
    weight was never written (found by review); only the rows written come back (the whole fp16 copy
    would round every other row)."""
    torch.manual_seed(0)
    eager = torch.nn.Embedding(10, 4, max_norm=1.0).eval()
    source = copy.deepcopy(eager)
    ids = torch.tensor([[1, 2, 3]])
    compiled = stof_cc.compile(source, (ids,), dtype=torch.float16, tune=False)
    with torch.no_grad():
        eager(ids)
        compiled(ids)
    torch.testing.assert_close(source.weight[1:4], eager.weight[1:4], rtol=1e-3, atol=1e-3)
    assert torch.equal(source.weight[4:], eager.weight[4:]) and torch.equal(source.weight[0], eager.weight[0])


class _ClonedView(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        return y.clone().view(-1), y


class _OnePieceCat(torch.nn.Module):
    def forward(self, x):
        return torch.cat([x], dim=0)


def test_outputs_that_eager_copies_share_no_storage():
    """A clone read through a view, and a cat of one piece, were dropped as identities: two outputs shared
    storage, and the cat handed back the caller's input (found by review)."""
    x = torch.randn(2, 4)
    a, b = stof_cc.compile(_ClonedView(), (x,), dtype=torch.float32, tune=False)(x)
    a.zero_()
    torch.testing.assert_close(b, x * 2)
    keep = x.clone()
    stof_cc.compile(_OnePieceCat(), (x,), dtype=torch.float32, tune=False)(x).mul_(0)
    torch.testing.assert_close(x, keep)


class _WritesAColumn(torch.nn.Module):
    def forward(self, cache, x):
        cache[:, :1].copy_(x)
        return cache.sum()


def test_a_cast_input_the_model_writes_gets_only_what_it_wrote():
    """Copying the whole fp16 copy back into the caller's fp32 cache rounded the columns the model never
    wrote (found by review)."""
    cache, x = torch.full((2, 4), 1.0001), torch.randn(2, 1)
    compiled = stof_cc.compile(_WritesAColumn(), (cache.half(), x.half()), dtype=torch.float16, tune=False)
    compiled(cache, x)
    assert torch.equal(cache[:, 1:], torch.full((2, 3), 1.0001))
    torch.testing.assert_close(cache[:, :1], x.half().float())


@pytest.mark.parametrize("switch", ["tune", "cuda_graphs"])
def test_compile_refuses_a_switch_that_is_not_a_bool(switch):
    """tune="no" is true in Python: it turned on what it asked to turn off, where stof_cc.backend refused it
    (found by a newcomer review)."""
    with pytest.raises(TypeError, match=f"stof_cc.compile: {switch} must be True or False, got 'no'"):
        stof_cc.compile(torch.nn.Linear(4, 4), (torch.randn(2, 4),), **{switch: "no"})
