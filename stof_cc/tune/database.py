"""The tuning database: the winners of the search, remembered across processes.

SQLite in the user cache directory (``$XDG_CACHE_HOME/stof-cc/tuning.sqlite``), overridable
by argument or by ``STOF_CC_TUNING_DB``. One row per key; the key hashes everything that
changes which parameters are best or whether they are legal:

* the template's name and a digest of its Jinja2 sources (the file and every file it
  imports) and of its Python spec class;
* the group's signature (ops, shapes, dtypes, mask statistics bucket: the caller's string);
* the GPU's name and compute capability, and the CUDA version.

Writes are single SQLite transactions (atomic), and WAL journaling with a busy timeout lets
two processes tune at once without losing a record. Nothing read back is trusted blindly: a
record whose parameters do not parse is dropped with a warning (and re-tuned by the caller),
and a file that is not a database is moved aside with a warning and replaced by a fresh one.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
import sqlite3
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stof_cc.templates.registry import KernelTemplate, template_file_text

SCHEMA_VERSION = 1
_IMPORT = re.compile(r"""\{%-?\s*(?:import|from|include|extends)\s+["']([^"']+)["']""")


class TuningDatabaseWarning(UserWarning):
    """A record or the database file could not be trusted and was discarded."""


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
    key: str
    template: str
    signature: str
    device: str
    params: dict[str, Any]
    micros: float
    created: float


def template_digest(template: KernelTemplate) -> str:
    """sha256 of the template's Jinja2 source, every file it imports (transitively), and its
    spec class's Python source: any edit to what renders or constrains it changes the key."""
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
        if cls.__module__.startswith("stof_cc") or cls is type(template):
            digest.update(_class_source(cls).encode())
    return digest.hexdigest()


@functools.cache
def _class_source(cls: type) -> str:
    """A class's Python source, read once per process: `inspect.getsource` parses the whole
    module (2-7 ms), and a warm compile of BERT-base looks up 336 keys (7.7 of its 8 s on the
    H100 before this cache). A class object's source cannot change while it exists."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # made at run time (no source file): its name stands in
        return cls.__qualname__


def default_path() -> Path:
    if os.environ.get("STOF_CC_TUNING_DB"):
        return Path(os.environ["STOF_CC_TUNING_DB"])
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return Path(cache) / "stof-cc" / "tuning.sqlite"


class TuningDatabase:
    """Best parameters per (template digest, group signature, device)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._connect()
        except sqlite3.DatabaseError as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            warnings.warn(f"tuning database {self.path} is unreadable ({exc}); moved to {aside}, starting empty",
                          TuningDatabaseWarning, stacklevel=2)
            self._connect()

    def _connect(self) -> None:
        self._db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, template TEXT NOT NULL, "
            "signature TEXT NOT NULL, device TEXT NOT NULL, params TEXT NOT NULL, micros REAL NOT NULL, "
            "created REAL NOT NULL, schema INTEGER NOT NULL)")

    def close(self) -> None:
        self._db.close()

    @staticmethod
    def key(template: KernelTemplate, signature: str, device: Device) -> str:
        parts = [str(SCHEMA_VERSION), template.name, template_digest(template), signature, device.name,
                 f"{device.capability[0]}.{device.capability[1]}", device.cuda]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def lookup(self, template: KernelTemplate, signature: str, device: Device) -> Record | None:
        """The stored winner, or None (never stored, or stored for an older template/device)."""
        key = self.key(template, signature, device)
        row = self._db.execute("SELECT key, template, signature, device, params, micros, created, schema "
                               "FROM records WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        try:
            params = json.loads(row[4])
            if not isinstance(params, dict) or row[7] != SCHEMA_VERSION or not row[5] > 0:
                raise ValueError("not a parameter dictionary of this schema with a positive time")
        except ValueError as exc:
            warnings.warn(f"tuning record for {template.name} / {signature} is corrupt ({exc}); ignored and "
                          "removed, the group will be re-tuned", TuningDatabaseWarning, stacklevel=2)
            self._db.execute("DELETE FROM records WHERE key = ?", (key,))
            return None
        return Record(row[0], row[1], row[2], row[3], params, float(row[5]), float(row[6]))

    def store(self, template: KernelTemplate, signature: str, device: Device, params: dict[str, Any],
              micros: float) -> Record:
        """Remember ``params`` (measured at ``micros``) as the winner; replaces an older record."""
        record = Record(self.key(template, signature, device), template.name, signature,
                        f"{device.name} sm_{device.capability[0]}{device.capability[1]} CUDA {device.cuda}",
                        dict(params), float(micros), time.time())
        self._db.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (record.key, record.template, record.signature, record.device,
                          json.dumps(record.params, sort_keys=True), record.micros, record.created, SCHEMA_VERSION))
        return record

    def records(self) -> list[Record]:
        rows = self._db.execute("SELECT key, template, signature, device, params, micros, created FROM records "
                                "ORDER BY template, signature").fetchall()
        out = []
        for row in rows:
            try:
                params = json.loads(row[4])
            except ValueError:
                params = {"<corrupt>": row[4]}
            out.append(Record(row[0], row[1], row[2], row[3], params, float(row[5]), float(row[6])))
        return out

    def clear(self) -> int:
        """Forget every record; returns how many there were."""
        count = self._db.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        self._db.execute("DELETE FROM records")
        return int(count)
