"""Several GPUs (issue 22): a kernel launches on torch's current device, loading itself into that
device's context the first time; `stof_cc.attention` and compiled modules make their inputs'
device current. The routing is tested on the CPU with stand-ins; the runs on a second GPU are
GPU tests that skip where torch sees one device."""

from __future__ import annotations

import pytest
import torch

from stof_cc.backends import pycuda_backend
from stof_cc.backends.pycuda_backend import Kernel


class Recorder:
    """Stands in for PyCUDA's function and for DriverKernel: records each launch."""

    made: list[tuple] = []

    def __init__(self, *args, **kwargs) -> None:
        self.launches: list[tuple] = []
        Recorder.made.append(args)

    def launch(self, grid, threads, shared, stream, *args) -> None:
        self.launches.append((grid, stream, args))

    def prepared_call(self, grid, block, *args, shared_size) -> None:
        self.launches.append((grid, "pycuda", args))


@pytest.fixture
def on_device(monkeypatch):
    """Make `device` torch's current device (and stream 0 current) for the kernel's launch."""
    state = {"device": 0, "stream": 0}
    monkeypatch.setattr(pycuda_backend, "current_device", lambda: state["device"])
    monkeypatch.setattr(pycuda_backend, "current_raw_stream", lambda device: state["stream"])
    monkeypatch.setattr(pycuda_backend, "DriverKernel", Recorder)
    Recorder.made = []
    return state


def test_a_kernel_launches_on_the_current_device_loading_itself_there_once(on_device):
    import threading

    kernel = Kernel("k", None, None, Recorder(), cubin=b"cubin", arg_format="Pi", loaded_on=0,
                    loaded_thread=threading.get_ident())
    kernel.launch((1, 1, 1), 32, 0, 1234, 5)  # its own device, default stream, PyCUDA's thread: PyCUDA's function
    assert kernel._function.launches == [((1, 1, 1), "pycuda", (1234, 5))] and not kernel._on_devices
    on_device["device"] = 1
    kernel.launch((2, 1, 1), 32, 0, 99, 6)
    kernel.launch((3, 1, 1), 32, 0, 98, 7)
    assert list(kernel._on_devices) == [1] and len(Recorder.made) == 2  # loaded into device 1 once
    assert kernel._on_devices[1].launches == [((2, 1, 1), 0, (99, 6)), ((3, 1, 1), 0, (98, 7))]
    on_device["device"], on_device["stream"] = 0, 777  # a user stream on device 0: the driver path there
    kernel.launch((4, 1, 1), 32, 0, 1, 2)
    assert kernel._on_devices[0].launches == [((4, 1, 1), 777, (1, 2))]
    on_device["stream"] = 0  # another thread, PyCUDA's device and stream: PyCUDA has no context there
    worker = threading.Thread(target=kernel.launch, args=((5, 1, 1), 32, 0, 3, 4))
    worker.start()
    worker.join()
    assert kernel._on_devices[0].launches[-1] == ((5, 1, 1), 0, (3, 4))
    assert len(kernel._function.launches) == 1


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
def test_attention_runs_on_the_device_of_its_inputs():
    """cuda:0 named explicitly, and (with a second GPU) cuda:1 while cuda:0 is current."""
    import stof_cc
    from stof_cc import masks
    from stof_cc.ir.reference import masked_attention, relative_error

    devices = ["cuda:0"] + (["cuda:1"] if _two_gpus() else [])
    mask = masks.sliding_window(64)
    for device in devices:
        q, k, v = (torch.randn(2, 4, 512, 64, device=device, dtype=torch.float16) for _ in range(3))
        with torch.cuda.device(0):
            out = stof_cc.attention(q, k, v, mask)
        assert out.device == q.device
        assert relative_error(out, masked_attention(q, k, v, mask.to_dense(512, 512).to(device))) < 1e-2, device


@pytest.mark.gpu
def test_one_process_holds_compiled_modules_on_two_devices():
    """The bar's single-process check: the same model compiled on cuda:0 and on cuda:1 (the second
    GPU's half skips where torch sees one device), each matching eager on its device."""
    import sys
    from pathlib import Path

    import stof_cc

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import copy

    from gpt2_block import GPT2Block

    torch.manual_seed(8)
    model = GPT2Block().eval()
    devices = ["cuda:0"] + (["cuda:1"] if _two_gpus() else [])
    compiled, inputs, models = {}, {}, {}
    for device in devices:  # one copy of the model per device (.to() moves a module in place)
        models[device] = copy.deepcopy(model).to(device).half()
        inputs[device] = torch.randn(2, 128, 128, device=device, dtype=torch.float16)
        with torch.cuda.device(0):
            compiled[device] = stof_cc.compile(models[device], (inputs[device],), tune=False)
    for device in devices:  # both held, called alternately
        with torch.no_grad(), torch.cuda.device(0):
            got = compiled[device](inputs[device])
            want = models[device](inputs[device])
        assert got.device == torch.device(device)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
def test_a_fresh_process_whose_first_call_is_on_the_second_gpu():
    """PyCUDA's import retains (and makes current) one device's context: the first stof-cc call of
    a process on cuda:1 must leave cuda:1 current and compute there."""
    import subprocess
    import sys

    script = (
        "import torch, stof_cc\n"
        "from stof_cc import masks\n"
        "from stof_cc.ir.reference import masked_attention, relative_error\n"
        "torch.cuda.set_device(1)\n"
        "q, k, v = (torch.randn(2, 4, 256, 64, device='cuda:1', dtype=torch.float16) for _ in range(3))\n"
        "out = stof_cc.attention(q, k, v, masks.causal())\n"
        "assert torch.cuda.current_device() == 1, torch.cuda.current_device()\n"
        "want = masked_attention(q, k, v, masks.causal().to_dense(256, 256).to('cuda:1'))\n"
        "assert out.device == q.device and relative_error(out, want) < 1e-2\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
