"""benchmarks/on_gpus.sh deals commands to GPUs (here two pretended ones: GPUS=2) and reports
each command's output and exit status, and which ones its time limit stopped or skipped."""

from __future__ import annotations

import os
import subprocess

from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "on_gpus.sh"


def _run(logs, *commands, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"GPUS": "2"} | env
    return subprocess.run(["bash", str(SCRIPT), str(logs), *commands], capture_output=True, text=True,
                          env=environment, timeout=60)


def test_commands_go_to_the_gpus_in_turn_each_with_its_log_and_status(tmp_path):
    run = _run(tmp_path, "echo a=$CUDA_VISIBLE_DEVICES", "echo b=$CUDA_VISIBLE_DEVICES; exit 3",
               "echo c=$CUDA_VISIBLE_DEVICES")
    assert "a=0\nexit status 0" in run.stdout and "b=1\nexit status 3" in run.stdout and "c=0\nexit status 0" in run.stdout
    assert (tmp_path / "1.log").read_text() == "b=1\nexit status 3\n"
    assert run.returncode == 1  # a command failed
    assert _run(tmp_path, "true", "true").returncode == 0


def test_the_gpus_are_taken_from_the_callers_visible_list(tmp_path):
    run = _run(tmp_path, "echo a=$CUDA_VISIBLE_DEVICES", "echo b=$CUDA_VISIBLE_DEVICES", CUDA_VISIBLE_DEVICES="5,7")
    assert "a=5\n" in run.stdout and "b=7\n" in run.stdout


def test_a_time_limit_names_what_it_stopped_and_what_never_ran_even_in_a_reused_folder(tmp_path):
    assert _run(tmp_path, "true", "true", "true").returncode == 0  # leaves 0.log 1.log 2.log behind
    run = _run(tmp_path, "sleep 5", "echo quick", "echo after", LIMIT="1")
    assert "(stopped: its GPU's share ran out of time)" in run.stdout
    assert "quick\nexit status 0" in run.stdout
    assert "(not run: its GPU's share ran out of time before it)" in run.stdout
    assert run.returncode == 1
