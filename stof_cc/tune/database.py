"""The tuning database: the winners of the search, remembered across processes.

SQLite in the user cache directory (``$XDG_CACHE_HOME/stof-cc/tuning.sqlite``), overridable
by argument or by ``STOF_CC_TUNING_DB``. One row per key; the key hashes everything that
changes which parameters are best or whether they are legal:

* the template's name and a digest of its Jinja2 sources (the file and every file it
  imports), of the Python modules defining its spec class and its base classes (a user's too),
  and of the modules that write part of its source (``renders_with``: the group chains' code
  generator);
* the group's signature (ops, shapes, dtypes, mask statistics bucket: the caller's string);
* the GPU's name and compute capability, and the CUDA version.

The database is a cache: trouble with it costs a re-measurement, never a compile, and never
a good record. Writes are single SQLite transactions (atomic), and WAL journaling lets
processes read while one writes. What can go wrong, and what happens then:

* a path that cannot hold a database (a directory, ``''``, under a file, a folder that cannot be
  created) raises `TuningDatabaseError`, and an argument that is no path at all a TypeError;
  nothing there is touched (`check_database_argument` checks the same before anything is opened);
* the file deleted or replaced while open (another process moved it aside, a user removed it):
  noticed before every read and write by its identity (st_dev, st_ino), and the path reopened
  with a warning, so that no record goes into a file no later open can find;
* busy: another process holding the write lock makes a write wait up to ``timeout``
  (`BUSY_TIMEOUT`); past it the write is skipped with a `TuningDatabaseWarning` (the record is
  measured again next time). A lock is never taken for damage: nothing busy is moved;
* read-only (the file or its folder): it is opened for reading (immutable when the folder is
  read-only, since SQLite could not create the WAL index), lookups work, and writes are
  skipped with a warning;
* a row that does not parse is never trusted: it is skipped with a warning and removed;
* a file written by a newer stof-cc (its ``records`` table has our columns and more) is read as
  ours but never written into, moved or cleaned, with a warning (moved aside, its records were lost
  to the newer version that wrote them: found by review), and a newer version's rows are skipped,
  never removed;
* a file that is not a database, is malformed, or holds another tool's ``records`` table is
  moved aside (the regular file we opened, with its -wal and -shm, to
  ``<name>.corrupt-<time>-<pid>``) with a warning, and a fresh one started; read-only, it is
  left in place and not used.

``TuningDatabase(path, read_only=True)`` (`stof-cc cache list`) only reads: a missing file or one
that is not a tuning database is a `TuningDatabaseError`, and nothing is created, moved or written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
import re
import sqlite3
import threading
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stof_cc.ir.paths import blocking_file, folder_lock, user_cache_root
from stof_cc.templates.registry import KernelTemplate, template_file_text

if TYPE_CHECKING:
    from stof_cc.tune.library import LibraryGemm

SCHEMA_VERSION = 1
IDENTITY_TRIES = 5  # opens of a path replaced while opening it, before the last one stands (`_connect`)
BUSY_TIMEOUT = 60.0  # seconds a write waits for another process's lock before it is skipped
_IMPORT = re.compile(r"""\{%-?\s*(?:import|from|include|extends)\s+["']([^"']+)["']""")
_COLUMNS = ("key", "template", "signature", "device", "params", "micros", "created", "schema")
_CREATE = ("CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, template TEXT NOT NULL, "
           "signature TEXT NOT NULL, device TEXT NOT NULL, params TEXT NOT NULL, micros REAL NOT NULL, "
           "created REAL NOT NULL, schema INTEGER NOT NULL)")
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM records"
_DELETE_ROW = "DELETE FROM records WHERE " + " AND ".join(f"{column} IS ?" for column in _COLUMNS)  # one row, as read
_INSERT = f"INSERT OR REPLACE INTO records ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
_HOW = "give a file path (`stof-cc cache --db` / `stof-cc tune --db`, or the database argument), or set STOF_CC_TUNING_DB"
_T = TypeVar("_T")


class TuningDatabaseError(RuntimeError):
    """The database path cannot be used at all (a directory, empty, not creatable, not openable)."""


class NewerDatabaseError(TuningDatabaseError):
    """The file was written by a newer stof-cc: read as ours, never written into, moved or cleaned."""


class DamagedDatabaseError(TuningDatabaseError):
    """Only reading: the file is a database whose pages SQLite reports damaged (a write cut short,
    a disk error). A writer moves such a file aside and starts an empty one."""


class TuningDatabaseWarning(UserWarning):
    """A record or the database could not be used (busy, read-only, corrupt): the record is
    ignored or not saved, and measured again."""


@dataclass(frozen=True)
class Device:
    """What the key records about the GPU the parameters were measured on."""

    name: str
    capability: tuple[int, int]
    cuda: str

    @staticmethod
    def current() -> Device:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: tuning records are keyed by the GPU they were measured on")
        return Device(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), str(torch.version.cuda))


@dataclass(frozen=True)
class Record:
    """A template's winner for a group, or (``micros`` infinite: `failed`) the note that stage 2
    found no correct point of it there (``params`` then holds ``{"failed": why}``): a warm database
    skips such a template instead of measuring it again every compile, and a group whose every
    template failed runs in torch, never on an unchecked default point."""

    key: str
    template: str
    signature: str
    device: str
    params: dict[str, Any]
    micros: float
    created: float

    @property
    def failed(self) -> bool:
        return math.isinf(self.micros)

    @property
    def why_failed(self) -> str:
        return str(self.params.get("failed", "no point compiled, launched and matched torch"))


def template_digest(template: KernelTemplate) -> str:
    """sha256 of the template's Jinja2 source, every file it imports (transitively), the Python
    modules of its spec class and its bases, and its ``renders_with`` modules: any edit to what
    renders or constrains it changes the key (a code generator or a user's base class changed kept
    the old records, and their points ran unchecked: found by review)."""
    digest = hashlib.sha256()
    seen: set[str] = set()
    pending = [template.source_file]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        text = template_file_text(template.template_dir, name)  # imports may live in stof-cc's folder
        digest.update(name.encode() + b"\0" + text.encode())
        pending += _IMPORT.findall(text)
    for cls in type(template).__mro__:
        if cls.__module__ not in _LANGUAGE_MODULES:  # stof-cc's bases and a user's own bases alike
            digest.update(_module_source(cls).encode())
    for module in template.renders_with:
        digest.update(_source_of(module).encode())
    return digest.hexdigest()


_LANGUAGE_MODULES = ("builtins", "abc", "typing")  # object, ABC, Generic: no template's own code


@functools.cache
def _module_source(cls: type) -> str:
    """The Python source of the module defining ``cls``, whole: the constants and helpers beside a
    template class (its stage counts, tile heights, shared-memory limit, multicast twins) decide its
    points as much as the class does, and with the class alone an edit to them kept the old records
    (found by review). Read once per process: `inspect.getsource` parses the whole module (2-7 ms),
    and a warm compile of BERT-base looks up 336 keys (7.7 of its 8 s on the H100 before this cache).
    A class made at run time (no source file) is read as its code (`_class_code`)."""
    try:
        return _source_of(inspect.getmodule(cls))
    except (OSError, TypeError):
        return _class_code(cls)


def _class_code(cls: type) -> str:
    """A class with no source file (``python -c``, a notebook): its name, the bytecode and
    constants of its methods and its plain constants (keyed by its name alone, an edit to its
    ``context()`` kept the old records: found by review)."""
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for name, value in sorted(vars(cls).items()):
        function = getattr(value, "__func__", value)  # static and class methods too
        if hasattr(function, "__code__"):
            parts.append(f"{name}:{_code_text(function.__code__)}")
        elif isinstance(value, str | int | float | bool | tuple):
            parts.append(f"{name}={value!r}")
    return "\n".join(parts)


def _code_text(code: types.CodeType) -> str:
    """What a code object computes: its bytecode, the names it reads and its constants (nested
    code objects likewise: their repr holds an address)."""
    consts = ",".join(_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return f"{code.co_code.hex()}|{','.join(code.co_names)}|{consts}"


@functools.cache
def _source_of(module) -> str:
    return inspect.getsource(module)


def default_path() -> Path:
    if os.environ.get("STOF_CC_TUNING_DB"):
        return Path(os.environ["STOF_CC_TUNING_DB"]).expanduser()
    return user_cache_root() / "stof-cc" / "tuning.sqlite"


def check_database_argument(database: object, argument: str) -> None:
    """Refuse a ``database`` argument (`stof_cc.compile`, `stof_cc.backend`) that can never name a
    tuning database, touching nothing: where no GPU runs it is never opened, and a wrong one would
    pass unnoticed. Each error message begins with ``argument``."""
    if database is not None and not isinstance(database, TuningDatabase):
        _database_path(database, argument, "a TuningDatabase, a file path or None")


def _database_path(path: object, culprit: str, expected: str) -> Path:
    """``path`` as a Path, checked without touching the disk: TypeError when it is no path (says
    it should be ``expected``), `TuningDatabaseError` when it is empty, something other than a
    regular file, or under a file; each message starts with ``culprit``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{culprit} must be {expected}, got {type(path).__name__}")
    if not os.fspath(path):
        raise TuningDatabaseError(f"{culprit}: the path is empty; {_HOW}")
    path = Path(path).expanduser()  # '~/db.sqlite' quoted past the shell names the home folder, not ./~
    if os.path.exists(path) and not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        how = _HOW.replace(", or set STOF_CC_TUNING_DB", "") if "STOF_CC_TUNING_DB" in culprit else _HOW
        raise TuningDatabaseError(f"{culprit} {path} is {kind}; {how}")
    blocker = blocking_file(path.parent)
    if blocker is not None:
        raise TuningDatabaseError(f"{culprit} {path}: {blocker} is a file, not a folder; {_HOW}")
    return path


def _read_only(path: Path) -> bool:
    """Whether the database at ``path`` (a `_database_path`) can only be read, creating its folder
    when missing; `TuningDatabaseError` when it cannot be used at all."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TuningDatabaseError(f"tuning database {path}: cannot create the folder {path.parent} "
                                  f"({exc.strerror}); {_HOW}") from None
    folder_writable = os.access(path.parent, os.W_OK)
    if not path.exists():
        if not folder_writable:
            raise TuningDatabaseError(f"tuning database {path} cannot be created: the folder {path.parent} is "
                                      f"read-only; {_HOW}")
        return False
    return not (folder_writable and os.access(path, os.W_OK))


def _trouble(exc: sqlite3.Error) -> str:
    """What an SQLite error means here: "busy" (another connection holds the lock past the
    timeout), "read-only", "empty" (no table yet), "corrupt" (SQLite reports a damaged file as a
    bare DatabaseError; another tool's table shows as a missing column), or "other"."""
    text = str(exc)
    if "locked" in text or "busy" in text:
        return "busy"
    if "readonly" in text:
        return "read-only"
    if "no such table" in text:
        return "empty"
    if type(exc) is sqlite3.DatabaseError or "no such column" in text:
        return "corrupt"
    return "other"


def _identity(path: Path) -> os.stat_result | None:
    """The file at ``path`` (None: none yet, SQLite creates it)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _damaged(exc: sqlite3.Error) -> bool:
    """SQLite's word for a database file whose pages do not hold together (one cut short, a
    flipped byte): not another tool's file."""
    return "malformed" in str(exc)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class _NewerRecord(ValueError):
    """A row a newer stof-cc wrote: not ours to read, nor to remove."""


def _record(row: tuple) -> Record:
    """A row as `TuningDatabase.store` writes it, or ValueError: whatever else is in the
    file (another schema, a field of the wrong type, a time that is not a number) is not trusted."""
    key, template, signature, device, params, micros, created, schema = row
    if not all(isinstance(text, str) for text in (key, template, signature, device, params)):
        raise ValueError("a text field is not text")
    if isinstance(schema, int) and schema > SCHEMA_VERSION:
        raise _NewerRecord(f"schema {schema}, newer than {SCHEMA_VERSION}")
    if schema != SCHEMA_VERSION:
        raise ValueError(f"schema {schema!r}, not {SCHEMA_VERSION}")
    failure = isinstance(micros, float) and micros == math.inf  # `Record.failed`
    if not ((failure or (_finite(micros) and micros > 0)) and _finite(created)):
        raise ValueError(f"time {micros!r} us, created {created!r}: not numbers")
    try:
        parsed = json.loads(params)
    except RecursionError:  # not a ValueError: it crashed lookups (found by review)
        raise ValueError("the parameters nest too deeply") from None
    if not isinstance(parsed, dict):
        raise ValueError("the parameters are not a dictionary")
    scalars = (str, int, float, bool, type(None))
    if not all(isinstance(value, scalars) for value in parsed.values()):
        raise ValueError("a parameter is not a number, a string, a bool or null")
    return Record(key, template, signature, device, parsed, float(micros), float(created))


class TuningDatabase:
    """Best parameters per (template digest, group signature, device). ``timeout``: seconds a
    write waits for another process's lock (`BUSY_TIMEOUT`); ``read_only``: only read an existing
    tuning database (`stof-cc cache list`). See the module docstring for what happens when the
    file is busy, read-only, corrupt or replaced."""

    def __init__(self, path: str | Path | None = None, *, timeout: float = BUSY_TIMEOUT,
                 read_only: bool = False) -> None:
        self.timeout = timeout
        self._turns = threading.RLock()  # one thread at a time on the connection (`_safely`)
        self._only_reading = read_only
        self.written_by_newer = False  # set only reading (`_check_ours`): `cache clear` refuses such a file
        self._open(default_path() if path is None else path)

    def _open(self, path: object) -> None:
        """Connect to the file at ``path`` (checked by `_database_path`) and make it ready: its
        folder and table created where it can be written. Only reading, the file must exist and be
        a tuning database: nothing is created, and nothing else is worth listing."""
        self.path = _database_path(path, "tuning database", "a file path or None")
        if self._only_reading and not os.path.isfile(self.path):
            raise TuningDatabaseError(f"tuning database {self.path} does not exist")
        self.read_only = self._only_reading or _read_only(self.path)
        self._connect()
        if self._only_reading:
            self._check_ours()
        else:
            self._safely(self._prepare, None, "records may be neither found nor saved")

    def _connect(self) -> None:
        """Open the file: read-only with ``mode=ro``, and immutable where SQLite would otherwise
        create the WAL's index (-shm) and log beside it: a read-only folder, where it cannot, and
        only reading a file no writer has open (no -wal, -shm), where it must not."""
        uri = self.path.absolute().as_uri()
        if self.read_only:
            writer_open = all(os.path.exists(f"{self.path}{suffix}") for suffix in ("-wal", "-shm"))
            shared = os.access(self.path.parent, os.W_OK) and (writer_open or not self._only_reading)
            uri += "?mode=ro" if shared else "?mode=ro&immutable=1"
        # the file's identity: `_move_aside` moves this file only, never one put in its place, and
        # `_reopen_if_replaced` notices when the path leads elsewhere. Taken before and after opening,
        # until both agree: a rank that moved a damaged file aside between this one's open and its stat
        # gave it the fresh file's identity, and this one then moved the fresh, good file (found by review)
        for _ in range(IDENTITY_TRIES):
            before = _identity(self.path)
            try:
                # any thread: a compiled module called from a server's workers looks records up from them
                # (refused with "SQLite objects created in a thread can only be used in that same thread"
                # before); `_safely` takes turns on it
                self._db = sqlite3.connect(uri, uri=True, timeout=self.timeout, isolation_level=None,
                                           check_same_thread=False)
            except sqlite3.Error as exc:
                raise TuningDatabaseError(f"tuning database {self.path} cannot be opened ({exc}); {_HOW}") from None
            self._opened = os.stat(self.path)
            if before is not None and os.path.samestat(before, self._opened):
                return
            self._db.close()
        self._db = sqlite3.connect(uri, uri=True, timeout=self.timeout, isolation_level=None, check_same_thread=False)
        self._opened = os.stat(self.path)  # a path replaced under every try: the last open stands

    def _prepare(self) -> None:
        """WAL journaling and the table (when writable), and `_columns`' check that a ``records``
        table is ours. Runs before every write too, since opening a busy file may have left it
        unprepared. Another tool's file (tables, none of them ``records``) is foreign too: the table was
        created inside it, and its journal switched to WAL for good (a review)."""
        if not self.read_only:
            tables = [row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            if tables and "records" not in tables:
                raise sqlite3.DatabaseError(f"another tool's file (tables {', '.join(tables)}; no records table)")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_CREATE)
        self._columns()

    def _columns(self) -> tuple[str, ...]:
        """The ``records`` table's columns (none: no table yet); sqlite3.DatabaseError for another
        tool's table: a foreign file, never read or written into."""
        columns = tuple(row[1] for row in self._db.execute("PRAGMA table_info(records)"))
        if columns[:len(_COLUMNS)] == _COLUMNS and len(columns) > len(_COLUMNS):
            raise NewerDatabaseError(f"tuning database {self.path} was written by a newer stof-cc (its records have "
                                      f"the columns {', '.join(columns[len(_COLUMNS):])} too): read, never written into")
        if columns and columns != _COLUMNS:
            raise sqlite3.DatabaseError(f"a records table of another layout: {', '.join(columns)}")
        return columns

    def _check_ours(self) -> None:
        """Only reading: `TuningDatabaseError` unless the file holds our ``records`` table (a newer
        stof-cc's, with more columns, is read as ours: `cache list` lists it) or no table at all (an
        empty file, which a writer would fill: no records)."""
        try:
            ours = bool(self._columns()) or not self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        except NewerDatabaseError:
            ours = self.written_by_newer = True
        except sqlite3.Error as exc:
            if _damaged(exc):
                raise DamagedDatabaseError(f"{self.path} is damaged ({exc})") from None
            what = "is not a tuning database" if _trouble(exc) == "corrupt" else "cannot be read"
            raise TuningDatabaseError(f"{self.path} {what} ({exc})") from None
        if not ours:
            raise TuningDatabaseError(f"{self.path} is not a tuning database (it has no records table)")

    def _written_since_opened(self) -> bool:
        """Whether the file at the path changed (size or time) since this connection opened it."""
        try:
            now = os.stat(self.path)
        except OSError:
            return False
        return (now.st_size, now.st_mtime_ns) != (self._opened.st_size, self._opened.st_mtime_ns)

    def _reopen_if_replaced(self) -> None:
        """Reopen the path, with a warning, when the file there is no longer the one opened
        (deleted, replaced, or moved aside by another process): records written into a file no
        path leads to are lost to every later open. One stat per read or write."""
        try:
            if os.path.samestat(os.stat(self.path), self._opened):
                return
            change = "replaced by another file"
        except OSError:
            change = "deleted or moved away"
        warnings.warn(f"tuning database {self.path} was {change} while open; reopening the path",
                      TuningDatabaseWarning, stacklevel=4)
        # Empty the WAL this connection holds (its own file's, left at the path or moved along with
        # it) into that file before closing: SQLite does not checkpoint a moved or deleted file on
        # close, and would apply a -wal left at the path to whatever file is there now.
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()
        self._open(self.path)

    def _safely(self, action: Callable[[], _T], fallback: _T, consequence: str, retry: bool = True) -> _T:
        """``action()`` on the file at the path (`_reopen_if_replaced`); on SQLite trouble
        (`_trouble`) ``fallback`` with a warning that ends with ``consequence``, except that a
        corrupt, writable file is moved aside and the action retried once on a fresh one, and a
        missing table simply gives ``fallback``. A path that can no longer be opened gives
        ``fallback`` with a warning too."""
        with self._turns:  # one thread at a time on the connection
            try:
                self._reopen_if_replaced()
                return action()
            except TuningDatabaseError as exc:
                warnings.warn(f"{exc}; {consequence}", TuningDatabaseWarning, stacklevel=3)
                return fallback
            except sqlite3.Error as exc:
                trouble = _trouble(exc)
                if trouble == "empty":
                    return fallback
                if trouble == "corrupt" and retry and not self.read_only:
                    self._move_aside(exc)
                    return self._safely(action, fallback, consequence, retry=False)
                state = {"busy": f"is locked by another process (waited {self.timeout:g} s)",
                         "read-only": "is read-only",
                         "corrupt": f"is unreadable ({exc}) and could not be moved aside"}.get(trouble, f"failed ({exc})")
                warnings.warn(f"tuning database {self.path} {state}; {consequence}", TuningDatabaseWarning, stacklevel=3)
                return fallback

    def _move_aside(self, exc: sqlite3.Error) -> None:
        """Rename the file this connection opened, with its -wal and -shm (the WAL belongs to it
        and must not be applied to the fresh file), to ``<name>.corrupt-<time>-<pid>``, and open
        a fresh one. Only that very file: if another process has already moved it, or it cannot
        be renamed, this just reopens the path."""
        self._db.close()
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{os.getpid()}")
        # one process at a time checks, renames and opens the fresh file: between another's check and its
        # rename, this one's fresh file could otherwise be what it moves
        with folder_lock(self.path.parent, exclusive=True):
            with contextlib.suppress(OSError):
                if os.path.samestat(os.stat(self.path), self._opened):
                    for suffix in ("", "-wal", "-shm"):
                        with contextlib.suppress(FileNotFoundError):
                            os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
                    warnings.warn(f"tuning database {self.path} is unreadable ({exc}); moved to {aside}, starting "
                                  "empty", TuningDatabaseWarning, stacklevel=4)
            self._connect()

    def close(self) -> None:
        self._db.close()

    @staticmethod
    def key(template: KernelTemplate | LibraryGemm, signature: str, device: Device) -> str:
        # a library choice (tune/library.py) has no sources: it digests its versions itself
        digest = template.digest() if hasattr(template, "digest") else template_digest(template)
        parts = [str(SCHEMA_VERSION), template.name, digest, signature, device.name,
                 f"{device.capability[0]}.{device.capability[1]}", device.cuda]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def lookup(self, template: KernelTemplate | LibraryGemm, signature: str, device: Device) -> Record | None:
        """The stored winner, or None (never stored, stored for an older template/device, or
        the database could not be read)."""
        key = self.key(template, signature, device)
        return self._safely(lambda: self._find(key), None, "the stored parameters were not used")

    def _find(self, key: str) -> Record | None:
        row = self._db.execute(f"{_SELECT} WHERE key = ?", (key,)).fetchone()
        return None if row is None else self._trusted(row)

    def _trusted(self, row: tuple) -> Record | None:
        """The row as a Record, or None, with a warning, when it does not parse; then it is
        removed (where the file can be written) so that it is measured again."""
        try:
            return _record(row)
        except _NewerRecord:  # a newer version's: skipped, and kept for it
            return None
        except ValueError as exc:
            warnings.warn(f"tuning record {row[1]} / {row[2]} in {self.path} is corrupt ({exc}); ignored, it "
                          "will be measured again", TuningDatabaseWarning, stacklevel=2)
            with contextlib.suppress(sqlite3.Error):  # read-only or busy: it stays, and is ignored again
                # that very row: another process may have stored a good record under the key since (found by review)
                self._db.execute(_DELETE_ROW, row)
            return None

    def store(self, template: KernelTemplate | LibraryGemm, signature: str, device: Device, params: dict[str, Any],
              micros: float) -> Record:
        """Remember ``params`` (measured at ``micros``) as the winner; replaces an older record.
        ``micros`` infinite records that no point of ``template`` worked (`store_failure`).
        Busy past the timeout or read-only: not saved, with a warning."""
        record = Record(self.key(template, signature, device), template.name, signature,
                        f"{device.name} sm_{device.capability[0]}{device.capability[1]} CUDA {device.cuda}",
                        dict(params), float(micros), time.time())
        self._safely(lambda: self._write(record), None,
                     "the record was not saved (it will be measured again next time)")
        return record

    def store_failure(self, template: KernelTemplate, signature: str, device: Device, why: str) -> Record:
        """Remember that stage 2 found no correct point of ``template`` for ``signature`` (`Record.failed`)."""
        return self.store(template, signature, device, {"failed": why[:500]}, math.inf)

    def _write(self, record: Record) -> None:
        self._prepare()
        self._db.execute(_INSERT, (record.key, record.template, record.signature, record.device,
                                   json.dumps(record.params, sort_keys=True), record.micros, record.created,
                                   SCHEMA_VERSION))

    def records(self, strict: bool = False) -> list[Record]:
        """Every record that parses, by template and signature (those that do not are skipped,
        with a warning, and removed). A file SQLite cannot read gives none, with a warning (a
        writer moves a damaged one aside first); ``strict``: `DamagedDatabaseError` for a damaged
        file instead, as a listing says."""
        if strict:
            for _ in range(IDENTITY_TRIES):
                try:
                    with self._turns:
                        self._reopen_if_replaced()
                        return self._all()
                except sqlite3.Error as exc:
                    if not _damaged(exc):
                        break
                    if not self._written_since_opened():
                        raise DamagedDatabaseError(f"{self.path} is damaged ({exc})") from None
                    # opened immutable (no writer had it open), then a writer changed it: the pages read
                    # were another version's, not damage (the listing told a healthy file to be cleared:
                    # found by review); open it again
                    self._db.close()
                    self._connect()
        return self._safely(self._all, [], "no records were listed")

    def _all(self) -> list[Record]:
        rows = self._db.execute(f"{_SELECT} ORDER BY template, signature").fetchall()
        return [record for record in map(self._trusted, rows) if record is not None]

    def clear(self) -> int | None:
        """Forget every record; returns how many there were, or None where nothing could be cleared
        (read-only, locked: a warning says which)."""
        return self._safely(self._delete_all, None, "nothing was cleared")

    def _delete_all(self) -> int:
        self._prepare()
        return self._db.execute("DELETE FROM records").rowcount
