"""The cubin cache of `backends/nvcc.py` under damage and hostile settings: damaged entries are
rebuilt (a cubin that no longer matches its recorded sha256 with a warning), a read-only folder
compiles uncached with one warning, a file in the way is a clear error, files follow the umask,
and concurrent compiles of one source leave one valid entry."""

from __future__ import annotations

import errno
import os
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stof_cc.backends import nvcc
from stof_cc.backends.nvcc import (
    CompileError,
    KernelCacheError,
    KernelCacheWarning,
    cache_dir,
    compile_cubin,
    compile_many,
)
from stof_cc.ir import paths

KERNEL = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n'
OTHER = 'extern "C" __global__ void k2(float* x) { x[threadIdx.x] *= 2.0f; }\n'


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache folder (``$STOF_CC_CACHE/cubin``) for one test."""
    monkeypatch.setenv("STOF_CC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cubin"


@pytest.fixture
def nvcc_runs(monkeypatch) -> list:
    """The nvcc compiles (not ``nvcc --version``) run during the test."""
    runs, real = [], subprocess.run

    def counting(cmd, *args, **kwargs):
        if "-cubin" in cmd:
            runs.append(cmd)
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting)
    return runs


@pytest.fixture
def read_only(cache, tmp_path, monkeypatch):
    """Make the cache folder unwritable: chmod for ordinary users, and, since root writes through
    chmod, refuse creating files in it at ``os.open`` (which the cache's writer uses). Sources
    the cache cannot take go to ``tmp_path/scratch``, not a new folder in /tmp."""
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(nvcc, "_scratch", tmp_path / "scratch")
    real_open = os.open

    def deny(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == cache:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    def make_read_only():
        cache.chmod(0o555)
        monkeypatch.setattr(os, "open", deny)

    yield make_read_only
    cache.chmod(0o755)


def _only(cache: Path, suffix: str) -> Path:
    (path,) = cache.glob(f"*{suffix}")
    return path


@pytest.mark.nvcc
@pytest.mark.parametrize("damage", [
    lambda b: b[: len(b) // 2],  # truncated: the section header table lies past the end
    lambda b: b[:64],  # the ELF header alone
    lambda b: b"",
    lambda b: b"garbage " * 100,
    lambda b: b"\x7fELF\x02\x01" + bytes(len(b) - 6),  # the magic, then zeros: no sections
    # 8 bytes flipped mid-file: a whole, valid ELF, served as a hit before the sha256 (issue 32, item 12)
    lambda b: b[:len(b) // 2] + bytes(x ^ 0xFF for x in b[len(b) // 2:len(b) // 2 + 8]) + b[len(b) // 2 + 8:],
], ids=["truncated", "header-only", "empty", "garbage", "magic-then-zeros", "bytes-flipped"])
def test_damaged_cubin_is_rebuilt_with_a_warning(cache, nvcc_runs, damage):
    first = compile_cubin(KERNEL)
    cubin_path = _only(cache, ".cubin")
    cubin_path.write_bytes(damage(first.cubin))
    with pytest.warns(KernelCacheWarning, match=f"kernel cache entry {cubin_path} does not match the sha256 "
                                                r"recorded in \w+\.ptxas\.txt: damaged, compiling it again"):
        again = compile_cubin(KERNEL)
    assert len(nvcc_runs) == 2
    assert again.cubin == first.cubin == cubin_path.read_bytes()
    assert again.resources["k"].registers > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile_cubin(KERNEL)
    assert len(nvcc_runs) == 2, "a valid entry is a quiet hit: no nvcc"


@pytest.mark.nvcc
def test_an_entry_without_a_recorded_sha256_is_rebuilt_quietly(cache, nvcc_runs):
    """An entry written before stof-cc recorded the cubin's hash cannot be trusted, nor is it damage."""
    compile_cubin(KERNEL)
    report = _only(cache, ".ptxas.txt")
    report.write_text(report.read_text().split("\n", 1)[1])  # ptxas's report alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_cubin(KERNEL).resources["k"].registers > 0
    assert len(nvcc_runs) == 2 and report.read_text().startswith("stof-cc: sha256 of the cubin: ")


@pytest.mark.nvcc
@pytest.mark.parametrize("report", [
    b"",
    b"\xff\xfe not text at all",
    b"ptxas info    : Compiling entry function 'k' for 'sm_90'\n",  # cut before its resource line
], ids=["empty", "garbage", "truncated"])
def test_unparsable_report_is_rebuilt(cache, nvcc_runs, report):
    compile_cubin(KERNEL)
    _only(cache, ".ptxas.txt").write_bytes(report)
    # what `stof-cc attention --build-dir` does: a KeyError here before the fix
    assert compile_cubin(KERNEL).resources["k"].registers > 0
    assert len(nvcc_runs) == 2
    assert "Used" in _only(cache, ".ptxas.txt").read_text()


@pytest.mark.nvcc
def test_damaged_cached_source_is_rewritten(cache):
    compile_cubin(KERNEL)
    source = _only(cache, ".cu")
    source.write_bytes(b"\xff\xfe\x00 not utf-8")
    assert compile_cubin(KERNEL).source_path == source
    assert source.read_text() == KERNEL


@pytest.mark.nvcc
def test_read_only_cache_compiles_uncached_with_one_warning(cache, read_only, nvcc_runs):
    read_only()
    with pytest.warns(KernelCacheWarning, match="not being cached") as caught:
        compiled = compile_cubin(KERNEL)
    assert len(caught) == 1 and str(cache) in str(caught[0].message)
    assert compiled.resources["k"].registers > 0 and compiled.cubin.startswith(b"\x7fELF")
    assert compiled.source_path.parent == cache.parent.parent / "scratch"
    assert compiled.source_path.read_text() == KERNEL
    assert list(cache.iterdir()) == []

    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        assert compile_many([(OTHER, "sm_90"), (KERNEL, "sm_90")]) == ["", ""]
    assert not [w for w in later if issubclass(w.category, KernelCacheWarning)], "one warning per folder"
    assert len(nvcc_runs) == 3 and list(cache.iterdir()) == []


@pytest.mark.nvcc
def test_a_file_system_that_refuses_locks_still_compiles_and_serves(cache, nvcc_runs, monkeypatch):
    """flock failing with ENOLCK (NFS without its lock daemon) raised a bare OSError from every compile,
    cached or new (a review): the entry lock is skipped there, as where the folder cannot be opened."""
    assert compile_cubin(KERNEL).cubin.startswith(b"\x7fELF")

    def no_locks(handle, mode):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(paths.fcntl, "flock", no_locks)  # the folder lock's (ir/paths.py)
    assert compile_cubin(KERNEL).cubin.startswith(b"\x7fELF") and len(nvcc_runs) == 1  # served from the cache
    assert compile_many([(OTHER, "sm_90")]) == [""] and len(nvcc_runs) == 2


@pytest.mark.nvcc
def test_read_only_cache_still_serves_its_entries(cache, read_only, nvcc_runs):
    first = compile_cubin(KERNEL)
    read_only()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = compile_cubin(KERNEL)
    assert again.cubin == first.cubin and again.source_path == first.source_path
    assert len(nvcc_runs) == 1


def test_cache_variable_naming_a_file_is_a_clear_error(tmp_path, monkeypatch):
    file = tmp_path / "cache.txt"
    file.write_text("not a folder")
    monkeypatch.setenv("STOF_CC_CACHE", str(file))
    with pytest.raises(KernelCacheError, match=f"STOF_CC_CACHE={file} is a file, not a folder; point "):
        cache_dir()
    with pytest.raises(KernelCacheError):  # once, not as every job's compile error
        compile_many([(KERNEL, "sm_90")])
    assert issubclass(KernelCacheError, CompileError)  # the CLI reports it as `stof-cc: error: ...`


@pytest.mark.parametrize("setting, blocker", [
    ("file/sub", "file"),  # a file among its parents
    ("folder", "folder/cubin"),  # a file where the cubin folder goes
])
def test_file_in_the_cache_path_is_a_clear_error(tmp_path, monkeypatch, setting, blocker):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    (tmp_path / "folder" / "cubin").write_text("")
    monkeypatch.setenv("STOF_CC_CACHE", str(tmp_path / setting))
    with pytest.raises(KernelCacheError, match=f"STOF_CC_CACHE={tmp_path / setting}: "
                                               f"{tmp_path / blocker} is a file, not a folder"):
        cache_dir()


def test_default_cache_under_a_file_names_the_folder_and_the_variable(tmp_path, monkeypatch):
    (tmp_path / "xdg").write_text("")
    monkeypatch.delenv("STOF_CC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(KernelCacheError, match=f"{tmp_path / 'xdg'} is a file, not a folder; "
                                               "point STOF_CC_CACHE at a folder you can write$"):
        cache_dir()


def test_cache_folder_that_cannot_be_created_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("STOF_CC_CACHE", "/proc/stof-cc-cache")  # /proc takes no new folders, even from root
    with pytest.raises(KernelCacheError, match="STOF_CC_CACHE=/proc/stof-cc-cache: cannot create "
                                               "/proc/stof-cc-cache/cubin"):
        cache_dir()


@pytest.mark.nvcc
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)], ids=["022", "002"])
def test_cache_files_follow_the_umask(cache, umask, mode):
    old = os.umask(umask)
    try:
        compile_cubin(KERNEL)
    finally:
        os.umask(old)
    for suffix in (".cubin", ".ptxas.txt", ".cu"):
        assert _only(cache, suffix).stat().st_mode & 0o777 == mode, suffix


@pytest.mark.nvcc
def test_concurrent_compiles_of_one_source_leave_one_valid_entry(cache):
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: compile_cubin(KERNEL), range(4)))
    assert len({r.cubin for r in results}) == 1 and results[0].cubin.startswith(b"\x7fELF")
    assert sorted(p.name.split(".", 1)[1] for p in cache.iterdir()) == ["cu", "cubin", "ptxas.txt"]
    assert nvcc._read_entry(_only(cache, ".cubin"), _only(cache, ".ptxas.txt")) is not None


@pytest.mark.nvcc
def test_nvcc_compiles_the_source_it_was_given_not_the_file_another_process_rewrote(cache, tmp_path, monkeypatch):
    """Two compiles into one build folder: the file at ``source_path`` may hold the other
    process's kernel by the time nvcc reads it. The cubin stored under this source's key must be
    this source's (two `stof-cc compile` runs stored each other's kernels: found by review)."""
    shared = tmp_path / "build" / "g0.cu"
    real_write = nvcc._write_source

    def overwritten_at_once(path, text):  # the other process writes right after this one
        written = real_write(path, text)
        if path == shared:
            shared.write_text(OTHER)
        return written

    monkeypatch.setattr(nvcc, "_write_source", overwritten_at_once)
    compiled = compile_cubin(KERNEL, source_path=shared)
    assert set(compiled.resources) == {"k"}  # KERNEL's function, not OTHER's k2
    with pytest.raises(CompileError, match=f"nvcc failed to compile {shared}") as error:
        compile_cubin(KERNEL.replace("+= 1.0f", "+= undefined_name"), source_path=shared)
    assert str(shared) in str(error.value).splitlines()[1]  # nvcc's own line names the user's file
    assert "undefined_name" in str(error.value)  # the line shown is the text compiled


@pytest.mark.nvcc
def test_nvcc_flags_from_the_environment_are_part_of_the_key(cache, nvcc_runs, monkeypatch):
    """NVCC_APPEND_FLAGS changes the cubin: an entry built with it is not served without it."""
    compile_cubin(KERNEL)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DSTOF_TEST_FLAG=1")
    compile_cubin(KERNEL)
    monkeypatch.delenv("NVCC_APPEND_FLAGS")
    compile_cubin(KERNEL)
    assert len(nvcc_runs) == 2


@pytest.mark.nvcc
def test_the_key_names_the_nvcc_that_compiles(cache, tmp_path, monkeypatch):
    """A process that met another nvcc first on PATH after its first compile filed that nvcc's cubins
    under the first one's key, served to every later process (found by review). The key and the command
    name the same nvcc: here a stand-in that reports another build and writes a cubin of another kernel."""
    real = nvcc.nvcc_path()
    kernel_cubin = compile_cubin(KERNEL).cubin  # the real nvcc's build, remembered
    (tmp_path / "k.cubin").write_bytes(kernel_cubin)
    (report,) = cache.glob("*.ptxas.txt")  # ptxas's lines, which the stand-in prints as nvcc -Xptxas -v does
    (tmp_path / "k.ptxas").write_text(report.read_text().partition("\n")[2])
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release 99.9, fake'; "
                    "exit 0; fi\nwhile [ $# -gt 1 ]; do [ \"$1\" = -o ] && out=$2; shift; done\n"
                    f"cp {tmp_path / 'k.cubin'} \"$out\"\ncat {tmp_path / 'k.ptxas'} >&2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert compile_cubin(OTHER).cubin == kernel_cubin  # the stand-in compiled it
    monkeypatch.setenv("PATH", f"{Path(real).parent}{os.pathsep}{os.environ['PATH']}")
    assert compile_cubin(OTHER).cubin != kernel_cubin  # the real nvcc's own entry, not the stand-in's


@pytest.mark.parametrize("xdg", ["", "relative/folder"], ids=["empty", "relative"])
def test_an_empty_or_relative_xdg_cache_home_means_the_home_cache(tmp_path, monkeypatch, xdg):
    """The XDG spec: an empty or relative XDG_CACHE_HOME is ignored. Taken as given, the kernel
    cache and the tuning database landed under the working directory (found by review)."""
    from stof_cc.tune.database import default_path

    monkeypatch.delenv("STOF_CC_CACHE", raising=False)
    monkeypatch.delenv("STOF_CC_TUNING_DB", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert cache_dir() == tmp_path / "home" / ".cache" / "stof-cc" / "cubin"
    assert default_path() == tmp_path / "home" / ".cache" / "stof-cc" / "tuning.sqlite"
    monkeypatch.setenv("STOF_CC_TUNING_DB", "~/tuning.sqlite")
    assert default_path() == tmp_path / "home" / "tuning.sqlite"
