"""runtime/capture.py: a variant's steps captured as CUDA graphs in pieces around collectives,
which run eagerly between them with their results copied where the next graph reads. On the CPU
a fake graph stands in: it records the steps run while capturing and runs them again, on the
same tensors, at replay (what a real graph's kernels do on their captured addresses)."""

from __future__ import annotations

import contextlib

import torch

from stof_cc.runtime import capture as capture_module


class FakeGraph:
    capturing = None

    def __init__(self):
        self.recorded = []

    def replay(self):
        for run_step, index, env in self.recorded:
            run_step(index, env)


def _fake_cuda(monkeypatch):
    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"  # other threads' CUDA work is not stopped by a capture
        FakeGraph.capturing = g
        yield
        FakeGraph.capturing = None

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_collectives_run_between_graphs_and_later_graphs_see_their_new_results(monkeypatch):
    _fake_cuda(monkeypatch)
    a, c = torch.zeros(4), torch.zeros(4)  # the graphs' outputs: fixed addresses, written in place
    calls = []

    def step(index, env):
        calls.append(index)
        if FakeGraph.capturing is not None:
            FakeGraph.capturing.recorded.append((step, index, dict(env)))
        if index == 0:
            a.copy_(env["x"] * 2)
            env["a"] = a
        elif index == 1:  # the "collective": a new tensor every call
            env["b"] = env["a"] + 1
        else:
            c.copy_(env["b"] * 3)
            env["c"] = c
            env.pop("b")

    x = torch.ones(4)
    env = {"x": x}
    run = capture_module.capture([False, True, False], step, env, stream=None)
    assert run.graphs == 2 and torch.equal(env["c"], torch.full((4,), 9.0))
    x.copy_(torch.full((4,), 2.0))  # a new input copied into the static one
    calls.clear()
    run.replay()
    assert calls == [0, 1, 2]
    assert torch.equal(c, torch.full((4,), 15.0))  # (2 * 2 + 1) * 3: the eager result reached the last graph


def test_a_variant_without_collectives_is_one_graph(monkeypatch):
    _fake_cuda(monkeypatch)
    run = capture_module.capture([False, False, False], lambda i, env: None, {}, stream=None)
    assert run.graphs == 1 and len(run.pieces) == 1
