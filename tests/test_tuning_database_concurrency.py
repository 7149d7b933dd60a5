"""The tuning database under concurrency: writers, a reader and a process holding the write lock.

A lock is contention, not damage: writers wait for it (up to their timeout) and lose nothing;
past the timeout a write is skipped with a warning, and nothing is ever moved aside.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import time
import warnings
from pathlib import Path

import pytest

from stof_cc.templates.elementwise import ELEMENTWISE
from stof_cc.tune.database import SCHEMA_VERSION, Device, TuningDatabase, TuningDatabaseWarning

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), "13.0")
WRITERS, RECORDS = 4, 25
HOLD = 1.5  # seconds the holder keeps the write lock
CTX = multiprocessing.get_context("fork")  # the children need no fresh interpreter (spawn imports torch: seconds)


def _hold(path: str, locked, seconds: float) -> None:
    """Another tool: take the write lock, write its own record, keep the lock ``seconds``, commit."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO records VALUES (?, 'elementwise', 'holder', 'dev', '{\"threads\": 64}', 5.0, ?, ?)",
               (TuningDatabase.key(ELEMENTWISE, "holder", H100), time.time(), SCHEMA_VERSION))
    locked.set()
    time.sleep(seconds)
    db.execute("COMMIT")


def _write(path: str, worker: int, timeout: float) -> None:
    warnings.simplefilter("error", TuningDatabaseWarning)  # a skipped write fails this process
    db = TuningDatabase(path, timeout=timeout)
    for i in range(RECORDS):
        db.store(ELEMENTWISE, f"w{worker}-{i}", H100, {"threads": 128, "vec": 1}, 1.0 + i)


def _read(path: str, done) -> None:
    warnings.simplefilter("error", TuningDatabaseWarning)
    db = TuningDatabase(path, timeout=10)
    while not done.is_set():  # what it finds is whole: the time it was stored with
        for i in range(RECORDS):
            record = db.lookup(ELEMENTWISE, f"w0-{i}", H100)
            assert record is None or record.micros == 1.0 + i


def _start(target, *args) -> multiprocessing.Process:
    process = CTX.Process(target=target, args=args)
    process.start()
    return process


def _finish(*processes: multiprocessing.Process) -> None:
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0, f"{process.name} exited with {process.exitcode}"


def _new_database(tmp_path: Path) -> str:
    path = tmp_path / "t.sqlite"
    db = TuningDatabase(path)
    db.store(ELEMENTWISE, "before", H100, {"threads": 32, "vec": 1}, 9.0)
    db.close()
    return str(path)


def test_writers_wait_for_a_lock_held_within_their_timeout_and_lose_nothing(tmp_path: Path):
    path = _new_database(tmp_path)
    locked, done = CTX.Event(), CTX.Event()
    holder = _start(_hold, path, locked, HOLD)
    assert locked.wait(10)
    reader = _start(_read, path, done)
    writers = [_start(_write, path, w, 4 * HOLD) for w in range(WRITERS)]
    _finish(holder, *writers)
    done.set()
    _finish(reader)
    db = TuningDatabase(path)
    for w in range(WRITERS):
        for i in range(RECORDS):
            assert db.lookup(ELEMENTWISE, f"w{w}-{i}", H100).micros == 1.0 + i
    assert db.lookup(ELEMENTWISE, "holder", H100).params == {"threads": 64}
    assert len(db.records()) == WRITERS * RECORDS + 2
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_a_lock_held_past_the_timeout_skips_the_write_and_moves_nothing(tmp_path: Path):
    path = _new_database(tmp_path)
    locked = CTX.Event()
    holder = _start(_hold, path, locked, HOLD)
    assert locked.wait(10)
    db = TuningDatabase(path, timeout=0.2)
    assert db.lookup(ELEMENTWISE, "before", H100).micros == 9.0  # reads do not wait for the writer
    with pytest.warns(TuningDatabaseWarning) as caught:
        db.store(ELEMENTWISE, "late", H100, {"threads": 128, "vec": 1}, 1.0)
    assert [str(w.message) for w in caught] == [
        f"tuning database {path} is locked by another process (waited 0.2 s); the record was not saved "
        "(it will be measured again next time)"]
    _finish(holder)
    assert not list(tmp_path.glob("*.corrupt-*"))
    assert db.lookup(ELEMENTWISE, "holder", H100).params == {"threads": 64}
    assert db.lookup(ELEMENTWISE, "late", H100) is None
    db.store(ELEMENTWISE, "late", H100, {"threads": 128, "vec": 1}, 1.0)  # released: saved this time
    assert TuningDatabase(path).lookup(ELEMENTWISE, "late", H100).micros == 1.0
