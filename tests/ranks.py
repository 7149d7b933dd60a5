"""Running a script on two ranks under torchrun, for the tests of several processes."""

from __future__ import annotations

import subprocess
import sys


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """Two ranks of ``args`` under torchrun --standalone. Its rendezvous port is picked free and
    bound a moment later, so a process starting beside it can take it first: one retry where the
    failure says so."""
    command = [sys.executable, "-W", "always", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 and "address already in use" in (run.stdout + run.stderr).lower():
        run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return run


def two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2
