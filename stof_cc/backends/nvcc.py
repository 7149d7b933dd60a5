"""Compile CUDA source to a cubin with nvcc, and read ptxas's resource report.

Used two ways: offline (CI, no GPU: does every template instantiation compile for sm_90,
and with how many registers and how much shared memory?) and at run time, where the
PyCUDA backend loads the cubin this produces. Cubins are cached on disk by a hash of
(source, arch, flags, nvcc's exact build, the NVCC_* flags of the environment), so a second compile
of the same kernel is a file read; nvcc compiles a private copy of the source, never a shared file.
The report beside each cubin records the cubin's sha256 on its first line: a cubin that no longer
matches it (damaged on disk, even inside a valid ELF) is rebuilt with a `KernelCacheWarning`
naming the file; a report without it (damaged, or written by an older stof-cc) or naming no kernel
is rebuilt quietly. A cache folder that cannot be written still serves its entries and compiles
the rest uncached, with one `KernelCacheWarning`. Entries are written atomically, with the
umask's permissions, so threads, processes and users can share one cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from stof_cc.ir.paths import blocking_file, folder_lock, user_cache_root

DEFAULT_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-lineinfo")


class CompileError(RuntimeError):
    """nvcc rejected a generated kernel; the message names the .cu file and line."""


class KernelCacheError(CompileError):
    """The cubin cache folder is a file or cannot be created; the message names it and the fix."""


class KernelCacheWarning(UserWarning):
    """The cubin cache folder cannot be written (kernels still compile, but are not cached), or an
    entry is damaged (it is compiled again)."""


@dataclass(frozen=True)
class Resources:
    """ptxas's report for one kernel."""

    kernel: str
    registers: int
    shared_bytes: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    # ptxas advisories C7510-C7519 "wgmma.mma_async instructions are serialized": a wgmma issued
    # under a branch (C7515), registers a wgmma reads written while one is in flight (C7513), ...;
    # costs 10-20% in attention
    wgmma_serialized: bool = False


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    arch: str
    resources: dict[str, Resources]
    source_path: Path


NVCC_MISSING = "nvcc not found: put the CUDA toolkit's bin/ on PATH or set CUDA_HOME"


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or (
        str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc") if "CUDA_HOME" in os.environ else None
    )


def nvcc_build() -> str:
    """The whole ``--version`` text of the nvcc found now (its exact build, not only the release):
    part of each cache key, so a toolkit updated in place (13.0.48 -> 13.0.88) never serves the old
    one's cubins."""
    return _build_of(_require_nvcc())


@functools.cache
def _build_of(exe: str) -> str:
    """``exe --version``, once per nvcc path: the key and the command of one compile name the same
    nvcc (a process that found another nvcc later filed its cubins under the first one's key:
    found by review)."""
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:  # a CUDA_HOME with no nvcc in it, say
        where = "from PATH" if shutil.which("nvcc") else f"from CUDA_HOME={os.environ.get('CUDA_HOME')}"
        raise CompileError(f"nvcc at {exe} ({where}) does not run ({exc}): point CUDA_HOME at a CUDA toolkit "
                           "or put its bin/ on PATH") from exc


def nvcc_version() -> str:
    """nvcc's release (``13.0``), for messages."""
    out = nvcc_build()
    match = re.search(r"release ([\d.]+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


# nvcc reads these from the environment and adds them to every command line: they change the
# cubin, so they are part of its key (a one-off NVCC_APPEND_FLAGS=-G would otherwise be served,
# and timed by stage 2, ever after: found by review)
NVCC_ENVIRONMENT = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")


def cache_dir() -> Path:
    """The cubin cache folder, created if missing: ``$STOF_CC_CACHE/cubin``, else under
    ``$XDG_CACHE_HOME`` or ``~/.cache``. Raises KernelCacheError when a file is in the way or
    the folder cannot be created (a traceback from mkdir would not say which setting to fix)."""
    env = os.environ.get("STOF_CC_CACHE")
    root = Path(env).expanduser() if env else user_cache_root() / "stof-cc"
    path = root / "cubin"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        name = f"STOF_CC_CACHE={env}" if env else str(root)
        blocker = blocking_file(path)
        problem = (f"{name} is a file, not a folder" if blocker == root
                   else f"{name}: {blocker} is a file, not a folder" if blocker
                   else f"{name}: cannot create {path} ({exc.strerror or exc})")
        fix = "point STOF_CC_CACHE at a folder you can write" + (", or unset it" if env else "")
        raise KernelCacheError(f"kernel cache unusable: {problem}; {fix}") from exc
    return path


def compile_cubin(source: str, arch: str = "sm_90", source_path: Path | None = None,
                  flags: tuple[str, ...] = DEFAULT_FLAGS) -> Compiled:
    """Compile ``source`` for ``arch`` (e.g. ``sm_90``); cached by content.

    ``source_path`` is where the user can read the source (the build folder); errors
    name it. Without one, the source is written next to the cache entry, or, when the cache
    folder cannot be written, to a temporary folder kept for this process. A cache entry
    that fails its checks (`_read_entry`) is rebuilt; one that cannot be stored is
    returned uncached, with a KernelCacheWarning (once per folder).
    """
    environment = [f"{name}={os.environ.get(name, '')}" for name in NVCC_ENVIRONMENT]
    nvcc = _require_nvcc()
    key = hashlib.sha256("\0".join([source, arch, *flags, _build_of(nvcc), *environment]).encode()).hexdigest()[:24]
    folder = cache_dir()
    cubin_path, report_path = folder / f"{key}.cubin", folder / f"{key}.ptxas.txt"
    if source_path is not None:
        _write_source(source_path, source)
    else:
        try:
            source_path = _write_source(folder / f"{key}.cu", source)
        except OSError:
            source_path = _write_source(_scratch_dir() / f"{key}.cu", source)
    with folder_lock(folder, exclusive=False):
        entry = _read_entry(cubin_path, report_path)
    if entry is not None:
        return Compiled(entry[0], arch, entry[1], source_path)

    with tempfile.TemporaryDirectory(prefix="stof-nvcc-") as tmp:
        # nvcc compiles a private copy of ``source``, never the file at ``source_path``: another
        # process writing the same build folder could put its own kernel there in between, and its
        # cubin would be cached under this key (two `stof-cc compile` runs into one folder did: found
        # by review). The #line directive keeps nvcc's messages naming the file the user can open.
        private, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        private.write_text(f"#line 1 {json.dumps(str(source_path))}\n{source}")
        cmd = [nvcc, *flags, f"-arch={arch}", "-cubin", "-Xptxas", "-v",
               "-o", str(out), str(private)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(_format_errors(source_path, source, proc.stderr))
        cubin = out.read_bytes()
    try:
        with folder_lock(folder, exclusive=True):  # another process may write this entry too
            _atomic_write(cubin_path, cubin)
            _atomic_write(report_path, f"{_DIGEST_LINE}{hashlib.sha256(cubin).hexdigest()}\n{proc.stderr}".encode())
    except OSError as exc:
        _warn_uncached(folder, exc)
    return Compiled(cubin, arch, parse_ptxas(proc.stderr), source_path)


def compile_many(jobs: list[tuple[str, str]], workers: int | None = None) -> list[str]:
    """Compile (source, arch) jobs into the cache in parallel (each nvcc is its own process);
    one entry per job: '' or its error message. Repeated jobs (identical layers) compile once.
    An unusable cache folder raises KernelCacheError once, rather than failing every job."""
    def one(job: tuple[str, str]) -> str:
        try:
            compile_cubin(job[0], arch=job[1])
        except KernelCacheError:  # the folder, not the source: every job would fail the same way
            raise
        except CompileError as exc:
            return str(exc)
        return ""

    if not jobs:
        return []
    cache_dir()
    distinct = list(dict.fromkeys(jobs))
    with ThreadPoolExecutor(max_workers=max(1, min(workers or os.cpu_count() or 1, len(distinct)))) as pool:
        errors = dict(zip(distinct, pool.map(one, distinct), strict=True))
    return [errors[job] for job in jobs]


def _require_nvcc() -> str:
    exe = nvcc_path()
    if exe is None:
        raise CompileError(NVCC_MISSING)
    return exe


_DIGEST_LINE = "stof-cc: sha256 of the cubin: "  # the report's first line, before ptxas's own
_lock = threading.Lock()  # compile_many calls compile_cubin from several threads
_scratch: Path | None = None
_warned: set[Path] = set()


def _read_entry(cubin_path: Path, report_path: Path) -> tuple[bytes, dict[str, Resources]] | None:
    """A cache entry's cubin and parsed report, or None (a miss) when either is missing or
    damaged: the report's first line must hold a sha256 and the cubin must match it (a
    mismatch warns, naming the cubin: bytes flipped inside a valid ELF pass every structural
    check), and the report must name at least one kernel, since callers index ``resources``
    by kernel name."""
    try:
        cubin, report = cubin_path.read_bytes(), report_path.read_bytes().decode(errors="replace")
    except OSError:
        return None
    first, _, ptxas = report.partition("\n")
    if not first.startswith(_DIGEST_LINE):
        return None
    if hashlib.sha256(cubin).hexdigest() != first.removeprefix(_DIGEST_LINE):
        warnings.warn(KernelCacheWarning(f"kernel cache entry {cubin_path} does not match the sha256 recorded in "
                                         f"{report_path.name}: damaged, compiling it again"), stacklevel=3)
        return None
    resources = parse_ptxas(ptxas)
    return (cubin, resources) if resources else None


def _write_source(path: Path, source: str) -> Path:
    """Write ``source`` to ``path`` (nvcc compiles that file; errors name it) unless it is there."""
    data = source.encode()
    with contextlib.suppress(OSError):
        if path.read_bytes() == data:
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, data)  # another process may be compiling the same source
    return path




def _atomic_write(path: Path, data: bytes) -> None:
    """Write to a unique temporary name, then rename: readers never see a partial file. Created
    with mode 0o666 so the kernel applies the umask (a cache shared between users stays readable)."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _scratch_dir() -> Path:
    """This process's folder for sources the cache folder cannot take; kept until exit (and
    after), since ``Compiled.source_path`` and ``Kernel.source_path`` point into it."""
    global _scratch
    with _lock:
        if _scratch is None:
            _scratch = Path(tempfile.mkdtemp(prefix="stof-cc-uncached-"))
        return _scratch


def _warn_uncached(folder: Path, exc: OSError) -> None:
    """One KernelCacheWarning per folder, not one per kernel (compile_many compiles hundreds)."""
    with _lock:
        if folder in _warned:
            return
        _warned.add(folder)
    warnings.warn(KernelCacheWarning(
        f"cannot write to the kernel cache folder {folder} ({exc.strerror or exc}): compiled kernels "
        "are not being cached; point STOF_CC_CACHE at a folder you can write"), stacklevel=3)


def _format_errors(source_path: Path, source: str, stderr: str) -> str:
    """Keep nvcc's ``file(line): error`` lines (they name the generated .cu) and show the line of
    ``source`` (the text compiled: the file may have been rewritten since)."""
    errors = [ln for ln in stderr.splitlines() if "error" in ln.lower()] or stderr.splitlines()[:20]
    lines = source.splitlines()
    shown = []
    for err in errors[:10]:
        shown.append(err)
        match = re.match(r".*?\((\d+)\): ", err)
        if match and lines and 0 < int(match.group(1)) <= len(lines):
            shown.append(f"    {int(match.group(1))} | {lines[int(match.group(1)) - 1].strip()}")
    return f"nvcc failed to compile {source_path}:\n" + "\n".join(shown)


_FUNCTION = re.compile(r"Compiling entry function '(\w+)'")
_SERIALIZED = re.compile(r"\(C751\d\) Potential Performance Loss: wgmma\.mma_async instructions are serialized.*?"
                         r"in the function '(\w+)'")
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
