"""The all-reduce of two tensor-parallel ranks by mirrored GEMM stores (runtime/peer_exchange.py):
the GEMM's second TMA store into the peer's symmetric-memory slot, the slots' alternation, and on
two GPUs the exchange against NCCL's all-reduce, eager and in a CUDA graph."""

from __future__ import annotations

import textwrap

import pytest
import torch
from ranks import torchrun, two_gpus

from stof_cc.codegen import NotFusable
from stof_cc.passes import lower
from stof_cc.runtime.peer_exchange import PeerExchange
from stof_cc.templates.gemm_epilogue import mirrored
from stof_cc.templates.group import MIRROR_MAP, OUTPUT_MAP, applicable_templates


def _gemm_problem(module: torch.nn.Module, x: torch.Tensor):
    graph, plan = lower(module, (x,))
    (group,) = [g for g in plan.default.groups if g.kind == "gemm"]
    found, _ = applicable_templates(graph, group, (9, 0))
    return found[0].template, found[0].problem


class _HeadSplit(torch.nn.Module):
    """A Q projection whose output leaves split into heads ([B, H, S, D]: not row-major)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(128, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).view(2, 64, 4, 32).transpose(1, 2)


def test_a_mirrored_gemm_stores_each_box_twice_through_a_second_tensor_map():
    template, problem = _gemm_problem(torch.nn.Linear(512, 1024, bias=False).half(), torch.randn(256, 512).half())
    params = template.default_params(problem)
    plain, twice = template.render(problem, params), template.render(mirrored(problem), params)
    assert "map_mirror" not in plain and plain.count("tma_store(&map_out") == 1
    assert twice.count("tma_store(&map_mirror, box") == 1 and "const __grid_constant__ TensorMap map_mirror" in twice
    maps = template.tensor_maps(mirrored(problem), params)
    assert [index for index, _, _ in maps][2:4] == [OUTPUT_MAP, MIRROR_MAP] and maps[2][1:] == maps[3][1:]
    assert template.kernel_name(mirrored(problem), params).endswith("_mirror")


def test_a_mirrored_output_takes_a_whole_tile_of_staging_boxes_where_it_fits():
    from stof_cc.templates.gemm_epilogue import staging_boxes

    template, problem = _gemm_problem(torch.nn.Linear(512, 1024, bias=False).half(), torch.randn(256, 512).half())
    three = {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 3}
    four = dict(three, stages=4)
    assert staging_boxes(problem.details, three) == 2 and staging_boxes(mirrored(problem).details, three) == 4
    assert staging_boxes(mirrored(problem).details, four) == 2  # beside four stages only the ring fits
    assert template.shared_bytes(mirrored(problem), three) <= 227 * 1024


def test_only_an_output_stored_by_tma_is_mirrored():
    template, problem = _gemm_problem(_HeadSplit().half(), torch.randn(2, 64, 128).half())
    assert not problem.details.tma_store
    with pytest.raises(NotFusable, match="TMA stores"):
        mirrored(problem)


@pytest.mark.nvcc
def test_a_mirrored_gemm_compiles():
    from stof_cc.backends.nvcc import compile_cubin

    template, problem = _gemm_problem(torch.nn.Linear(768, 768).half(), torch.randn(512, 768).half())
    for params in template.space(problem)[:: max(1, len(template.space(problem)) // 4)]:
        source = template.render(mirrored(problem), params)
        assert template.kernel_name(mirrored(problem), params) in compile_cubin(source, arch="sm_90a").resources


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7])
def test_consecutive_exchanges_never_share_a_slot_within_a_call_or_across_calls(count):
    slots = 1 if count == 1 else 2 if count % 2 == 0 else 3
    exchange = PeerExchange("0", slots, 1024, torch.empty(0), None, before_gemm=count == 1)
    order = [exchange.slot_of(i, count) for i in range(count)] * 2  # two calls
    assert set(order) <= set(range(slots))
    if count == 1:  # the peer may overwrite the one slot only after a barrier before the GEMM
        assert exchange.before_gemm
    else:
        assert all(a != b for a, b in zip(order[:-1], order[1:], strict=True)), order


def test_exchanges_whose_gemms_run_before_the_all_reduce_before_them_keep_nccl():
    from stof_cc.runtime.peer_exchange import Candidate, in_turn

    # steps: GEMM a (0), GEMM b (1), all-reduce a (2), all-reduce b (3), GEMM c (4), all-reduce c (5)
    a, b, c = Candidate("a", "0", 0, 2), Candidate("b", "0", 1, 3), Candidate("c", "0", 4, 5)
    assert [x.node for x in in_turn([c, b, a])] == ["a", "c"]  # b's GEMM would write a slot a's add still reads


def test_the_wait_on_an_exchanged_all_reduce_runs_inside_the_graphs_even_in_a_step_of_its_own():
    from types import SimpleNamespace

    from stof_cc.ir.graph import Ref
    from stof_cc.runtime.collectives import ALL_REDUCE
    from stof_cc.runtime.compiled import _outside_graphs

    nodes = {"ar": SimpleNamespace(op="opaque", target=ALL_REDUCE, args=(Ref("y"), "sum", "0")),
             "wait": SimpleNamespace(op="opaque", target="_c10d_functional.wait_tensor.default", args=(Ref("ar"),)),
             "ar2": SimpleNamespace(op="opaque", target=ALL_REDUCE, args=(Ref("z"), "sum", "0")),
             "wait2": SimpleNamespace(op="opaque", target="_c10d_functional.wait_tensor.default", args=(Ref("ar2"),))}
    graph = SimpleNamespace(node=nodes.__getitem__)
    steps = [SimpleNamespace(group=SimpleNamespace(nodes=[name])) for name in nodes]
    assert [_outside_graphs(graph, step, {"ar"}) for step in steps] == [False, False, True, True]


def test_a_graph_compiled_again_on_one_rank_takes_its_first_plan_or_says_why_it_cannot(monkeypatch):
    from types import SimpleNamespace

    from stof_cc.runtime import peer_exchange
    from stof_cc.runtime.collectives import ALL_REDUCE

    node = SimpleNamespace(name="ar", op="opaque", target=ALL_REDUCE, args=(None, "sum", "g"), spec="f16[8, 8]")
    graph = SimpleNamespace(name="dynamo_graph_7", nodes=lambda: [node], node=lambda name: node)
    monkeypatch.setattr(peer_exchange, "_group_size", lambda group_name: 2)
    monkeypatch.setattr(peer_exchange, "_mirrored_here", lambda *args: {})  # its GEMM is cuBLAS's now
    monkeypatch.setattr(peer_exchange, "agreed", lambda *args: pytest.fail("asked the other rank again"))
    key = ("dynamo_graph_7", "g", (("ar", "f16[8, 8]"),))
    monkeypatch.setitem(peer_exchange._PLANS, key, (("ar",), None))
    with pytest.raises(RuntimeError, match="compiled again on this rank.*STOF_CC_PEER_EXCHANGE=0"):
        peer_exchange.attach(graph, [], torch.device("cpu"))
    monkeypatch.setitem(peer_exchange._PLANS, key, ((), None))  # nothing was taken: nothing to ask
    assert peer_exchange.attach(graph, [], torch.device("cpu")) is None


def test_switched_off_a_rank_compiles_no_mirrored_gemm_and_offers_none(monkeypatch):
    from types import SimpleNamespace

    from stof_cc.runtime import peer_exchange
    from stof_cc.runtime.collectives import ALL_REDUCE

    node = SimpleNamespace(name="ar", op="opaque", target=ALL_REDUCE, args=(None, "sum", "g"), spec="f16[8, 8]")
    graph = SimpleNamespace(name="switched_off_graph", nodes=lambda: [node], node=lambda name: node)
    offered = []
    monkeypatch.setenv("STOF_CC_PEER_EXCHANGE", "0")
    monkeypatch.setattr(peer_exchange, "_group_size", lambda group_name: 2)
    monkeypatch.setattr(peer_exchange, "_mirrored_here", lambda *args: pytest.fail("compiled mirrored GEMMs"))
    monkeypatch.setattr(peer_exchange, "agreed", lambda names, found, *args: offered.append(found) or [])
    monkeypatch.setattr(peer_exchange, "_PLANS", {})
    assert peer_exchange.attach(graph, [], torch.device("cpu")) is None
    assert offered == [{}]  # it still takes part in the agreement, offering nothing: the other rank keeps NCCL too


def _exchanged_graph(second_reader: bool = False):
    """y (a GEMM's output, this rank's partial) all-reduced, then h = r + y and a LayerNorm of h: the
    residual add and the norm after a row-parallel GEMM, as a tensor-parallel graph holds them. With
    ``second_reader`` the all-reduced value is also a graph output (read outside the norm's group)."""
    from stof_cc.ir.graph import Graph, Ref
    from stof_cc.ir.node import Node, TensorSpec
    from stof_cc.runtime.collectives import ALL_REDUCE

    spec = TensorSpec((64, 256), torch.float16)
    graph = Graph("tp")
    for name in ("y", "r"):
        graph.add_input(name, spec)
    graph.add_constant("w", torch.randn(256).half())
    graph.add_constant("b", torch.randn(256).half())
    graph.add_node(Node("ar", "opaque", target=ALL_REDUCE, args=(Ref("y"), "sum", "g"), spec=spec))
    graph.add_node(Node("wait", "opaque", target="_c10d_functional.wait_tensor.default", args=(Ref("ar"),), spec=spec))
    graph.add_node(Node("h", "add", args=(Ref("r"), Ref("wait")), spec=spec))
    graph.add_node(Node("out", "layer_norm", args=(Ref("h"), [256], Ref("w"), Ref("b"), 1e-5), spec=spec))
    graph.outputs = [Ref("out")] + ([Ref("wait")] if second_reader else [])
    return graph


def _steps(graph):
    """Each group of the graph as a step: a kernel (its default point) where a template takes it."""
    from types import SimpleNamespace

    from stof_cc.passes import partition

    steps = []
    for group in partition(graph).default.groups:
        found, _ = applicable_templates(graph, group, (9, 0))
        kernel = (found[0].template, found[0].problem, found[0].template.default_params(found[0].problem)) \
            if found and group.kind != "opaque" else None
        steps.append(SimpleNamespace(group=group, kind="kernel" if kernel else "torch", kernel=kernel, mirror=None))
    return steps


def test_the_kernel_that_reads_an_exchanged_value_adds_the_received_partial_itself():
    from stof_cc.runtime.peer_exchange import Candidate, consumer_adding

    graph = _exchanged_graph()
    steps = _steps(graph)
    index, (template, problem, params), received = consumer_adding(graph, steps, Candidate("ar", "g", 0, 1))
    assert steps[index].group.anchor == "out" and received == "ar_received"
    assert {o.ref for o in problem.operands} >= {"ar", "ar_received", "r"} and "wait" not in {o.ref for o in problem.operands}
    assert problem.output == steps[index].kernel[1].output and params == steps[index].kernel[2]
    assert "ar_received" not in graph  # the model's graph is left as it was
    # the sum rounded to fp16 before the residual add, as the add after the barrier and NCCL round it: the same bits
    assert "__float2half_rn(in_v0)" in template.render(problem, params)


def test_a_kernel_adds_the_received_partial_only_before_the_next_exchanges_barrier(monkeypatch):
    """After the next exchange's barrier the other rank may write the slot again: a consumer at or after it
    keeps the add after its own barrier; so does a consumer that cannot be rebuilt, and a second all-reduce
    read by the same kernel."""
    from stof_cc.runtime import peer_exchange
    from stof_cc.runtime.peer_exchange import Candidate

    taken = [Candidate("ar3", "g", 9, 10), Candidate("ar1", "g", 0, 1), Candidate("ar2", "g", 4, 5)]  # not in order
    readers = {"ar1": 3, "ar2": 11, "ar3": 12}  # ar2's reader runs after ar3's barrier (step 10)

    def rebuilt(graph, steps, c):
        return (readers[c.node], None, f"{c.node}_received")

    monkeypatch.setattr(peer_exchange, "consumer_adding", rebuilt)
    assert sorted(peer_exchange.in_time(None, [], taken)) == ["ar1", "ar3"]
    readers["ar3"] = 3  # the kernel that adds ar1's partial: one all-reduce per consumer
    assert sorted(peer_exchange.in_time(None, [], taken)) == ["ar1"]

    def broken(graph, steps, c):
        raise KeyError(c.node)

    monkeypatch.setattr(peer_exchange, "consumer_adding", broken)
    with pytest.warns(UserWarning, match="added after the barrier"):
        assert peer_exchange.in_time(None, [], taken) == {}


def test_a_value_read_elsewhere_too_keeps_the_add_after_the_barrier():
    from stof_cc.runtime.peer_exchange import Candidate, consumer_adding

    graph = _exchanged_graph(second_reader=True)
    assert consumer_adding(graph, _steps(graph), Candidate("ar", "g", 0, 1)) is None
    graph = _exchanged_graph()
    steps = _steps(graph)
    for step in steps:
        step.kind = "torch"  # no generated kernel reads it
    assert consumer_adding(graph, steps, Candidate("ar", "g", 0, 1)) is None


def test_a_compile_that_raises_leaves_its_kernels_out_with_a_warning(monkeypatch):
    """An unusable kernel cache raises from compile_many: the rank keeps NCCL (before the agreement) or the add
    after the barrier (after it) instead of failing alone while the other rank waits for it."""
    from stof_cc.backends import nvcc, pycuda_backend
    from stof_cc.runtime import peer_exchange

    def unusable(jobs, workers=None):
        raise nvcc.KernelCacheError("the kernel cache folder is not writable")

    monkeypatch.setattr(pycuda_backend, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(nvcc, "compile_many", unusable)
    template, problem = _gemm_problem(torch.nn.Linear(512, 1024, bias=False).half(), torch.randn(256, 512).half())
    kernel = (template, mirrored(problem), template.default_params(problem))
    with pytest.warns(UserWarning, match="before %ar did not compile or load .*not writable.*runs in NCCL"):
        assert peer_exchange._loaded({"ar": kernel}, "the mirrored GEMM before %{name} did not compile or load "
                                                     "({why}); that all-reduce runs in NCCL") == {}


@pytest.mark.nvcc
def test_the_kernel_that_adds_the_received_partial_compiles():
    from stof_cc.backends.nvcc import compile_many
    from stof_cc.runtime.peer_exchange import Candidate, consumer_adding

    graph = _exchanged_graph()
    _, (template, problem, params), _ = consumer_adding(graph, _steps(graph), Candidate("ar", "g", 0, 1))
    assert compile_many([(template.render(problem, params), "sm_90a" + template.arch_features)]) == [""]


AGREEMENT = textwrap.dedent('''
    import sys
    import torch, torch.distributed as dist
    from types import SimpleNamespace
    from stof_cc.runtime import peer_exchange
    from stof_cc.runtime.collectives import ALL_REDUCE

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    names = ["ar_a", "ar_b", "ar_c"] + (["ar_d"] if sys.argv[2] == "uneven" and rank == 1 else [])
    nodes = {n: SimpleNamespace(name=n, op="opaque", target=ALL_REDUCE, args=(None, "sum", group)) for n in names}
    graph = SimpleNamespace(nodes=lambda: list(nodes.values()), node=nodes.__getitem__)
    mine = {"ar_a", "ar_b", "ar_c"} if rank == 0 else {"ar_a", "ar_c"}  # rank 1's ar_b: a cuBLAS GEMM, say
    candidates = {n: peer_exchange.Candidate(n, group, 0, 1) if n in mine else None for n in names}
    found = peer_exchange.agreed(peer_exchange.all_reduce_nodes(graph), candidates, group, torch.device("cpu"))
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as out:
        out.write(repr(found))
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.mark.slow
@pytest.mark.parametrize("graphs", ["same", "uneven"])
def test_ranks_take_peer_stores_only_where_every_rank_can(tmp_path, graphs):
    """Two gloo ranks: rank 1 cannot mirror the second all-reduce's GEMM, so neither rank takes it (one
    waiting in a barrier while the other ran NCCL would hang both); graphs with other all-reduce counts
    take none."""
    script = tmp_path / "agree.py"
    script.write_text(AGREEMENT)
    run = torchrun(str(script), str(tmp_path), graphs)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    want = ["ar_a", "ar_c"] if graphs == "same" else []
    for rank in (0, 1):
        assert eval((tmp_path / f"rank{rank}.txt").read_text()) == want  # noqa: S307 (the script's repr)


SCRIPT = textwrap.dedent('''
    import sys
    import torch, torch.distributed as dist
    from stof_cc.backends.group_launch import GroupLaunch
    from stof_cc.passes import lower
    from stof_cc.runtime.peer_exchange import PeerExchange
    from stof_cc.templates.gemm_epilogue import mirrored
    from stof_cc.templates.group import applicable_templates

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dtype = torch.bfloat16 if sys.argv[2] == "bf16" else torch.float16
    count, m, k, n = 3, 1000, 512, 768  # three exchanges: three slots; ragged rows
    linear = torch.nn.Linear(k, n, bias=False).to(device, dtype)
    x = torch.randn(m, k, device=device, dtype=dtype)
    graph, plan = lower(linear, (x,))
    (group,) = [g for g in plan.default.groups if g.kind == "gemm"]
    applicable = applicable_templates(graph, group, (9, 0))[0][0]
    problem = mirrored(applicable.problem)
    results = {}
    # the default point, a ring of two staging boxes, and a whole tile's four (a mirrored output takes them)
    for params in (applicable.template.default_params(problem),
                   {"schedule": "pingpong", "block_m": 64, "block_n": 128, "stages": 4},
                   {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 3}):
        launch = GroupLaunch(applicable.template, problem, params)
        exchange = PeerExchange.create(dist.group.WORLD.group_name, count, m * n * dtype.itemsize, device)
        weight = graph.constants[next(iter(graph.constants))]
        def run(inputs):
            outs = []
            for i, value in enumerate(inputs):
                slot = exchange.slot_of(i, count)
                out = launch({graph.inputs[0].name: value, **graph.constants},
                             exchange.peer_slot(slot, problem.shape, dtype))
                outs.append(exchange.finish(slot, out))
            return outs
        def want(inputs):
            outs = []
            for value in inputs:
                y = (value.float() @ weight.float().t()).to(dtype)
                dist.all_reduce(y)
                outs.append(y)
            return outs
        errors = []
        for call in range(2):  # eager, twice
            inputs = [torch.randn(m, k, device=device, dtype=dtype) * (i + 1) for i in range(count)]
            got, ref = run(inputs), want(inputs)
            errors += [((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, ref)]
        static = [torch.randn(m, k, device=device, dtype=dtype) for _ in range(count)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(static)
        torch.cuda.current_stream().wait_stream(side)
        graph_run = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_run):
            captured = run(static)
        for call in range(3):  # replayed with new inputs: the slots cycle across calls
            for t in static:
                t.copy_(torch.randn_like(t))
            graph_run.replay()
            ref = want(static)
            errors += [((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(captured, ref)]
        results[str(params)] = max(errors)
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as out:
        out.write(repr(results))
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs two GPUs")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_on_two_gpus_mirrored_stores_and_the_add_give_nccls_all_reduce(tmp_path, dtype):
    script = tmp_path / "exchange.py"
    script.write_text(SCRIPT)
    run = torchrun(str(script), str(tmp_path), dtype)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for rank in (0, 1):
        found = eval((tmp_path / f"rank{rank}.txt").read_text())  # noqa: S307 (the script's repr)
        assert len(found) == 3 and all(error < 1e-2 for error in found.values()), found
