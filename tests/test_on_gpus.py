"""benchmarks/on_gpus.sh deals commands to GPUs (here two pretended ones: GPUS=2) and reports
each command's output and exit status, and which ones its time limit stopped or skipped."""

from __future__ import annotations

import os
import subprocess

from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "on_gpus.sh"


def _run(tmp_path, *commands, **env):
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "logs"), *commands], capture_output=True, text=True,
                            env=os.environ | {"GPUS": "2"} | env, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_commands_go_to_the_gpus_in_turn_each_with_its_log_and_status(tmp_path):
    out = _run(tmp_path, "echo a=$CUDA_VISIBLE_DEVICES", "echo b=$CUDA_VISIBLE_DEVICES; exit 3",
               "echo c=$CUDA_VISIBLE_DEVICES")
    assert "a=0\nexit status 0" in out and "b=1\nexit status 3" in out and "c=0\nexit status 0" in out
    assert (tmp_path / "logs" / "1.log").read_text() == "b=1\nexit status 3\n"


def test_a_time_limit_names_what_it_stopped_and_what_never_ran(tmp_path):
    out = _run(tmp_path, "sleep 5", "echo quick", "echo after", LIMIT="1")
    assert "(stopped: its GPU's share ran out of time)" in out
    assert "quick\nexit status 0" in out
    assert "(not run: its GPU's share ran out of time before it)" in out
