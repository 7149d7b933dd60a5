"""Names made into paths, and files in the way of a folder: what every stage that writes files needs.

A model's name (its class name, or the CLI's FILE_FACTORY), a group's and a kernel's name become
file and folder names in the build folder. Names come from users, so each becomes one bounded path
component (`path_component`) and the joined path must stay inside its folder (`path_in`): a class
named ``../../x`` once wrote outside the build folder, and a 300-character one failed with
ENAMETOOLONG. This lives with the IR because the frontend names the graph, and the graph's name
names its build folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on Linux: no cross-process lock (`folder_lock`)
    fcntl = None

MAX_COMPONENT_BYTES = 96  # well under NAME_MAX (255), leaving room for suffixes such as ".cu"
_UNSAFE = re.compile(r"[^\w.-]")


class PathError(ValueError):
    """A file stof-cc would write resolves outside the folder it belongs in (a symbolic link)."""


def path_component(name: str) -> str:
    """``name`` as one readable file or folder name: characters other than letters, digits, ``.``,
    ``_`` and ``-`` become ``_``, as does a leading dot (never ``.``, ``..`` or hidden); past
    `MAX_COMPONENT_BYTES` it is cut and ends in a short hash of the whole name, so that long
    names stay distinct."""
    safe = _UNSAFE.sub("_", name)
    safe = "_" + safe[1:] if safe.startswith(".") else safe or "_"
    encoded = safe.encode()
    if len(encoded) <= MAX_COMPONENT_BYTES:
        return safe
    digest = hashlib.sha256(name.encode(errors="surrogatepass")).hexdigest()[:10]
    return encoded[:MAX_COMPONENT_BYTES - len(digest) - 1].decode(errors="ignore") + "-" + digest


def path_in(folder: Path, *names: str) -> Path:
    """``folder / name / ...``, each name made a `path_component`; `PathError` when the result
    resolves outside ``folder`` (a symbolic link inside it pointing elsewhere), naming both."""
    path = folder.joinpath(*map(path_component, names))
    if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder)):  # realpath: no raising
        raise PathError(f"{path} leads outside {folder} (through a symbolic link): not written there")
    return path


def blocking_file(path: Path) -> Path | None:
    """The file standing where ``path`` or one of its parents should be a folder, or None.
    Never raises (`os.path.isfile` answers False where a stat fails: no access, a name too long)."""
    return next((p for p in (path, *path.parents) if os.path.isfile(p)), None)


def user_cache_root() -> Path:
    """``$XDG_CACHE_HOME`` (``~`` expanded; empty counts as unset, as the XDG spec says), else
    ``~/.cache``: never a path relative to the working directory, where records and kernels would
    scatter over every folder a run starts in (found by review)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg).expanduser() if xdg else Path("~/.cache").expanduser()
    return root if root.is_absolute() else Path("~/.cache").expanduser()


@contextlib.contextmanager
def folder_lock(folder: Path, exclusive: bool) -> Iterator[None]:
    """A lock on a folder itself (no lock file), shared or ``exclusive``, across processes: the
    kernel cache's entries (read shared, written exclusive: processes compiling the same kernel at
    once never pair one's cubin with the other's report) and a tuning database moved aside (one
    process at a time checks and renames the file). No lock where fcntl is missing, the folder cannot
    be opened or its file system refuses locks (NFS without its lock daemon: ENOLCK); each user
    still checks what it reads (the cubin's sha256, the database's file identity)."""
    try:
        handle = os.open(folder, os.O_RDONLY) if fcntl is not None else None
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # no lock here: go on without it, as where the folder cannot be opened
            fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(handle)  # closing releases the lock
