"""Compile CUDA source to a cubin with nvcc, and read ptxas's resource report.

Used two ways: offline (CI, no GPU: does every template instantiation compile for sm_90,
and with how many registers and how much shared memory?) and at run time, where the
PyCUDA backend loads the cubin this produces. Cubins are cached on disk by a hash of
(source, arch, flags, nvcc version), so a second compile of the same kernel is a file read.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-lineinfo")


class CompileError(RuntimeError):
    """nvcc rejected a generated kernel; the message names the .cu file and line."""


@dataclass(frozen=True)
class Resources:
    """ptxas's report for one kernel."""

    kernel: str
    registers: int
    shared_bytes: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    # ptxas advisory C7515: it serialised the kernel's wgmma instructions (a wgmma issued under
    # a branch, or accumulators written while one is in flight); costs 10-20% in attention
    wgmma_serialized: bool = False


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    arch: str
    resources: dict[str, Resources]
    source_path: Path


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or (
        str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc") if "CUDA_HOME" in os.environ else None
    )


@functools.cache
def nvcc_version() -> str:
    exe = _require_nvcc()
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release ([\d.]+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


def cache_dir() -> Path:
    root = os.environ.get("STOF_CC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "stof-cc"
    )
    path = Path(root) / "cubin"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_cubin(source: str, arch: str = "sm_90", source_path: Path | None = None,
                  flags: tuple[str, ...] = DEFAULT_FLAGS) -> Compiled:
    """Compile ``source`` for ``arch`` (e.g. ``sm_90``); cached by content.

    ``source_path`` is where the user can read the source (the build folder); errors
    name it. Without one, the source is written next to the cache entry.
    """
    key = hashlib.sha256("\0".join([source, arch, *flags, nvcc_version()]).encode()).hexdigest()[:24]
    cubin_path = cache_dir() / f"{key}.cubin"
    report_path = cache_dir() / f"{key}.ptxas.txt"
    if source_path is None:
        source_path = cache_dir() / f"{key}.cu"
    if not source_path.exists() or source_path.read_text() != source:
        source_path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(source_path, source.encode())  # another process may be compiling the same source
    if cubin_path.exists() and report_path.exists():
        return Compiled(cubin_path.read_bytes(), arch, parse_ptxas(report_path.read_text()), source_path)

    with tempfile.TemporaryDirectory(prefix="stof-nvcc-") as tmp:
        out = Path(tmp) / "kernel.cubin"
        cmd = [_require_nvcc(), *flags, f"-arch={arch}", "-cubin", "-Xptxas", "-v",
               "-o", str(out), str(source_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(_format_errors(source_path, proc.stderr))
        cubin = out.read_bytes()
    _atomic_write(cubin_path, cubin)
    _atomic_write(report_path, proc.stderr.encode())
    return Compiled(cubin, arch, parse_ptxas(proc.stderr), source_path)


def compile_many(jobs: list[tuple[str, str]], workers: int | None = None) -> list[str]:
    """Compile (source, arch) jobs into the cache in parallel (each nvcc is its own process);
    one entry per job: '' or its error message. Repeated jobs (identical layers) compile once."""
    def one(job: tuple[str, str]) -> str:
        try:
            compile_cubin(job[0], arch=job[1])
        except CompileError as exc:
            return str(exc)
        return ""

    if not jobs:
        return []
    distinct = list(dict.fromkeys(jobs))
    with ThreadPoolExecutor(max_workers=max(1, min(workers or os.cpu_count() or 1, len(distinct)))) as pool:
        errors = dict(zip(distinct, pool.map(one, distinct), strict=True))
    return [errors[job] for job in jobs]


def _require_nvcc() -> str:
    exe = nvcc_path()
    if exe is None:
        raise CompileError("nvcc not found: put the CUDA toolkit's bin/ on PATH or set CUDA_HOME")
    return exe


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _format_errors(source_path: Path, stderr: str) -> str:
    """Keep nvcc's ``file(line): error`` lines (they name the generated .cu) and show the line."""
    errors = [ln for ln in stderr.splitlines() if "error" in ln.lower()] or stderr.splitlines()[:20]
    lines = source_path.read_text().splitlines() if source_path.exists() else []
    shown = []
    for err in errors[:10]:
        shown.append(err)
        match = re.match(r".*?\((\d+)\): ", err)
        if match and lines and 0 < int(match.group(1)) <= len(lines):
            shown.append(f"    {int(match.group(1))} | {lines[int(match.group(1)) - 1].strip()}")
    return f"nvcc failed to compile {source_path}:\n" + "\n".join(shown)


_FUNCTION = re.compile(r"Compiling entry function '(\w+)'")
_SERIALIZED = re.compile(r"\(C7515\).*?in the function '(\w+)'")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def parse_ptxas(report: str) -> dict[str, Resources]:
    """Parse ``-Xptxas -v`` output into one Resources per kernel (mangled names)."""
    out: dict[str, Resources] = {}
    current, info = None, {}
    for line in report.splitlines():
        if m := _FUNCTION.search(line):
            current, info = m.group(1), {"registers": 0, "shared": 0, "ss": 0, "sl": 0, "stack": 0}
        if current is None:
            continue
        if m := _STACK.search(line):
            info["stack"] = int(m.group(1))
        if m := _SPILL.search(line):
            info["ss"], info["sl"] = int(m.group(1)), int(m.group(2))
        if m := _USED.search(line):
            info["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                info["shared"] = int(s.group(1))
            out[current] = Resources(current, info["registers"], info["shared"], info["ss"], info["sl"], info["stack"])
    for m in _SERIALIZED.finditer(report):  # printed before the kernel's resource lines
        if m.group(1) in out:
            out[m.group(1)] = replace(out[m.group(1)], wgmma_serialized=True)
    return out
