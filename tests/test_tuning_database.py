"""The tuning database on the CPU: round trip, key invalidation, concurrent writers, corruption."""

from __future__ import annotations

import multiprocessing
import sqlite3
import warnings
from pathlib import Path

import pytest

from stof_cc.templates.elementwise import ELEMENTWISE, ElementwiseTemplate
from stof_cc.tune.database import Device, TuningDatabase, TuningDatabaseWarning, template_digest

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), "13.0")


def test_round_trip_and_listing(tmp_path: Path):
    db = TuningDatabase(tmp_path / "t.sqlite")
    assert db.lookup(ELEMENTWISE, "add+gelu f16[4096,768]", H100) is None
    db.store(ELEMENTWISE, "add+gelu f16[4096,768]", H100, {"threads": 256, "vec": 8}, 12.5)
    again = TuningDatabase(tmp_path / "t.sqlite")  # another connection, as another process would open it
    record = again.lookup(ELEMENTWISE, "add+gelu f16[4096,768]", H100)
    assert record.params == {"threads": 256, "vec": 8} and record.micros == 12.5 and "sm_90" in record.device
    assert again.lookup(ELEMENTWISE, "add+gelu f16[4096,768]", Device("NVIDIA A100", (8, 0), "13.0")) is None
    assert [r.signature for r in again.records()] == ["add+gelu f16[4096,768]"]
    assert again.clear() == 1 and again.records() == []


def test_key_changes_when_the_template_source_changes(tmp_path: Path):
    (tmp_path / "mine.cu.j2").write_text('{% import "shared.j2" as s %}kernel v1')
    (tmp_path / "shared.j2").write_text("helpers v1")

    class Mine(ElementwiseTemplate):
        name = "mine"
        source_file = "mine.cu.j2"
        template_dir = tmp_path

    template = Mine()
    db = TuningDatabase(tmp_path / "t.sqlite")
    db.store(template, "sig", H100, {"threads": 128, "vec": 1}, 3.0)
    before = template_digest(template)
    (tmp_path / "shared.j2").write_text("helpers v2")  # an imported file changes: old winners no longer apply
    assert template_digest(template) != before
    assert db.lookup(template, "sig", H100) is None


def _writer(path: str, worker: int) -> None:
    db = TuningDatabase(path)
    for i in range(40):
        db.store(ELEMENTWISE, f"w{worker}-{i}", H100, {"threads": 128, "vec": 1}, 1.0 + i)


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path):
    path = str(tmp_path / "t.sqlite")
    TuningDatabase(path).close()
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(path, w)) for w in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    assert len(TuningDatabase(path).records()) == 80


def test_corrupt_record_is_ignored_with_a_warning(tmp_path: Path):
    db = TuningDatabase(tmp_path / "t.sqlite")
    record = db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    raw = sqlite3.connect(tmp_path / "t.sqlite")
    raw.execute("UPDATE records SET params = '{not json' WHERE key = ?", (record.key,))
    raw.commit()
    with pytest.warns(TuningDatabaseWarning, match="corrupt"):
        assert db.lookup(ELEMENTWISE, "sig", H100) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert db.lookup(ELEMENTWISE, "sig", H100) is None  # removed: asked again, it is simply absent


def test_a_file_that_is_not_a_database_is_moved_aside(tmp_path: Path):
    path = tmp_path / "t.sqlite"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.warns(TuningDatabaseWarning, match="unreadable"):
        db = TuningDatabase(path)
    db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    assert db.lookup(ELEMENTWISE, "sig", H100).micros == 2.0
    assert len(list(tmp_path.glob("t.sqlite.corrupt-*"))) == 1


def test_cache_command_lists_and_clears(tmp_path: Path, capsys):
    from stof_cc.cli import main

    path = tmp_path / "t.sqlite"
    TuningDatabase(path).store(ELEMENTWISE, "add+gelu f16[8,768]", H100, {"threads": 256, "vec": 8}, 4.25)
    assert main(["cache", "list", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 record(s)" in out and "add+gelu f16[8,768]" in out and '"vec": 8' in out and "4.25 us" in out
    assert main(["cache", "clear", "--db", str(path)]) == 0
    assert "removed 1 record(s)" in capsys.readouterr().out
