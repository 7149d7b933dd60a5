"""The tuning database on the CPU: round trip, key invalidation, concurrent writers, and what it
does with paths it cannot use and files that are busy, read-only, malformed or foreign."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import warnings
from pathlib import Path

import pytest

from stof_cc.templates.elementwise import ELEMENTWISE, ElementwiseTemplate
from stof_cc.tune.database import (
    Device,
    TuningDatabase,
    TuningDatabaseError,
    TuningDatabaseWarning,
    template_digest,
)

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


def test_key_covers_the_code_generator_and_every_base_class(tmp_path: Path):
    """The chains of a group kernel are written by stof_cc.codegen, and a user's template may
    inherit its context() from a class of their own: an edit to either kept the old key, so the old
    points ran the new source unchecked (found by review)."""
    import importlib.util

    from stof_cc.codegen import chain, indexed

    assert set(ELEMENTWISE.renders_with) == {chain, indexed}

    def module(text: str, name: str):
        (tmp_path / f"{name}.py").write_text(text)
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded

    def digest_with(generator, base: type) -> str:
        leaf = type("Leaf", (base,), {"renders_with": (generator,), "__module__": __name__})
        return template_digest(leaf())

    one, two = module("SCALE = 1\n", "generator_one"), module("SCALE = 2\n", "generator_two")
    bases = module("from stof_cc.templates.elementwise import ElementwiseTemplate\n"
                   "class Base(ElementwiseTemplate):\n    name = 'base_a'\n", "bases_a").Base, \
        module("from stof_cc.templates.elementwise import ElementwiseTemplate\n"
               "class Base(ElementwiseTemplate):\n    name = 'base_b'\n", "bases_b").Base
    assert digest_with(one, bases[0]) == digest_with(one, bases[0])
    assert len({digest_with(one, bases[0]), digest_with(two, bases[0]), digest_with(one, bases[1])}) == 3


def test_key_of_a_template_class_without_a_source_file_follows_its_code():
    """``python -c`` or a notebook: no file to read, and the class was keyed by its name alone."""
    def defined(body: str) -> str:
        scope: dict = {"__name__": "a_notebook_cell", "ElementwiseTemplate": ElementwiseTemplate}
        exec(f"class Mine(ElementwiseTemplate):\n    name = 'mine'\n{body}", scope)  # noqa: S102
        return template_digest(scope["Mine"]())

    once = defined("    def context(self, problem, params):\n        return {'half': 1}\n")
    assert once == defined("    def context(self, problem, params):\n        return {'half': 1}\n")
    assert once != defined("    def context(self, problem, params):\n        return {'half': 2}\n")


def test_threads_share_one_database(tmp_path: Path):
    """A compiled module made in one thread and called from a server's workers looks records up
    from them: SQLite refused it ("objects created in a thread can only be used in that same
    thread"), with a warning per lookup, and the records went unused (seen on the GPU)."""
    from concurrent.futures import ThreadPoolExecutor

    db = TuningDatabase(tmp_path / "t.sqlite")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: db.store(ELEMENTWISE, f"sig{i}", H100, {"threads": 128, "vec": 1}, 1.0 + i),
                          range(32)))
            found = list(pool.map(lambda i: db.lookup(ELEMENTWISE, f"sig{i}", H100), range(32)))
    assert [r.micros for r in found] == [1.0 + i for i in range(32)]


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


def _corrupt_files(folder: Path) -> list[Path]:
    return list(folder.glob("*.corrupt-*"))


@pytest.mark.parametrize("make", ["directory", "empty", "under a file", "deeper under a file", "fifo"])
def test_an_unusable_path_is_refused_and_left_alone(tmp_path: Path, make: str):
    (tmp_path / "somefile").write_text("mine")
    if make == "directory":  # --db ~/.cache/stof-cc once moved the cubin cache aside
        path = tmp_path / "cache"
        path.mkdir()
        (path / "kernel.cubin").write_bytes(b"keep me")
    elif make == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    else:
        path = {"empty": "", "under a file": tmp_path / "somefile" / "t.sqlite",
                "deeper under a file": tmp_path / "somefile" / "sub" / "t.sqlite"}[make]
    before = sorted(tmp_path.iterdir())
    with pytest.raises(TuningDatabaseError, match="--db") as caught:
        TuningDatabase(path)
    assert (str(path) or "path is empty") in str(caught.value)
    assert caught.value.__context__ is None or caught.value.__suppress_context__  # no raw error chained
    assert sorted(tmp_path.iterdir()) == before
    assert (tmp_path / "somefile").read_text() == "mine"
    if make == "directory":
        assert (path / "kernel.cubin").read_bytes() == b"keep me"


def test_a_lock_held_past_the_timeout_is_busy_not_corrupt(tmp_path: Path):
    path = tmp_path / "t.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)  # another tool, on a new file: no WAL yet
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("CREATE TABLE theirs (x)")
    with pytest.warns(TuningDatabaseWarning, match=r"t.sqlite is locked by another process \(waited 0.1 s\)"):
        db = TuningDatabase(path, timeout=0.1)
    with pytest.warns(TuningDatabaseWarning, match="locked .*the stored parameters were not used"):
        assert db.lookup(ELEMENTWISE, "sig", H100) is None
    with pytest.warns(TuningDatabaseWarning, match="locked .*the record was not saved"):
        db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    holder.execute("INSERT INTO theirs VALUES (42)")
    holder.execute("COMMIT")
    assert not _corrupt_files(tmp_path)
    assert holder.execute("SELECT x FROM theirs").fetchall() == [(42,)]
    db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)  # released: the write goes through
    assert TuningDatabase(path).lookup(ELEMENTWISE, "sig", H100).micros == 2.0


def _malform(path: Path) -> None:
    """Overwrite every page but the first (the header and the schema) with garbage."""
    data = path.read_bytes()
    path.write_bytes(data[:4096] + b"\xff" * (len(data) - 4096))


def _foreign(path: Path) -> None:
    """Replace the table with another tool's ``records`` table."""
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("DROP TABLE records")
    raw.execute("CREATE TABLE records (id INTEGER PRIMARY KEY, name TEXT)")
    raw.execute("INSERT INTO records (name) VALUES ('theirs')")
    raw.close()


def _another_tools(path: Path) -> None:
    """Replace the table with another tool's tables, none named ``records`` (a writer created its table
    inside such a file and switched its journal to WAL: a review)."""
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("DROP TABLE records")
    raw.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    raw.execute("INSERT INTO users (name) VALUES ('theirs')")
    raw.execute("PRAGMA journal_mode=DELETE")
    raw.close()


def _filled(path: Path) -> None:
    """A closed database of 100 records: several pages."""
    db = TuningDatabase(path)
    for i in range(100):
        db.store(ELEMENTWISE, f"sig{i}", H100, {"threads": 128, "vec": 1}, 1.0 + i)
    db.close()


@pytest.mark.parametrize(("operation", "damage"), [  # a malformed page is only met when read, not at open
    *[(operation, _malform) for operation in ["lookup", "store", "records", "clear"]],
    *[(operation, _foreign) for operation in ["open", "lookup", "store", "records", "clear"]],
    ("open", _another_tools)])
def test_a_malformed_or_foreign_file_is_moved_aside_at_any_operation(tmp_path: Path, operation: str, damage):
    path = tmp_path / "t.sqlite"
    _filled(path)
    if operation != "open":
        db = TuningDatabase(path)
    damage(path)
    with pytest.warns(TuningDatabaseWarning, match=r"t.sqlite is unreadable .*moved to .*corrupt-.*starting empty"):
        if operation == "open":
            db = TuningDatabase(path)
        elif operation == "lookup":
            assert db.lookup(ELEMENTWISE, "sig1", H100) is None
        elif operation == "store":
            db.store(ELEMENTWISE, "new", H100, {"threads": 256, "vec": 2}, 3.0)
        elif operation == "records":
            assert db.records() == []
        else:
            assert db.clear() == 0
    assert len(_corrupt_files(tmp_path)) == 1
    if damage is not _malform:  # their data is kept, aside, as it was
        aside = sqlite3.connect(_corrupt_files(tmp_path)[0])
        table = "records" if damage is _foreign else "users"
        assert aside.execute(f"SELECT name FROM {table}").fetchall() == [("theirs",)]
        if damage is _another_tools:
            assert aside.execute("PRAGMA journal_mode").fetchone() == ("delete",)
            assert [row[0] for row in aside.execute("SELECT name FROM sqlite_master")] == ["users"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fresh file works quietly
        db.store(ELEMENTWISE, "new", H100, {"threads": 256, "vec": 2}, 3.0)
        assert db.lookup(ELEMENTWISE, "new", H100).micros == 3.0
        assert [r.signature for r in TuningDatabase(path).records()] == ["new"]
        assert db.lookup(ELEMENTWISE, "sig1", H100) is None


@pytest.mark.parametrize(("column", "value", "why"), [
    ("micros", "fast", "not numbers"), ("created", "yesterday", "not numbers"), ("micros", -1.0, "not numbers"),
    ("params", "[128, 1]", "not a dictionary"), ("params", "{not json", "Expecting"), ("schema", 0, "schema 0"),
    ("template", b"elementwise", "not text"), ("params", b"{}", "not text")])
def test_a_row_that_does_not_parse_is_skipped_and_removed(tmp_path: Path, column: str, value, why: str):
    db = TuningDatabase(tmp_path / "t.sqlite")
    good = db.store(ELEMENTWISE, "good", H100, {"threads": 128, "vec": 1}, 2.0)
    bad = db.store(ELEMENTWISE, "bad", H100, {"threads": 128, "vec": 1}, 2.0)
    raw = sqlite3.connect(tmp_path / "t.sqlite", isolation_level=None)
    raw.execute(f"UPDATE records SET {column} = ? WHERE key = ?", (value, bad.key))
    again = TuningDatabase(tmp_path / "t.sqlite")
    with pytest.warns(TuningDatabaseWarning, match=f"corrupt .*{why}"):
        assert db.lookup(ELEMENTWISE, "bad", H100) is None
    raw.execute(f"UPDATE records SET {column} = ? WHERE key = ?", (value, bad.key))  # no-op: it was removed
    raw.execute("INSERT INTO records SELECT ?, template, signature, device, params, micros, created, schema "
                "FROM records WHERE key = ?", ("other", good.key))
    raw.execute(f"UPDATE records SET {column} = ? WHERE key = 'other'", (value,))
    with pytest.warns(TuningDatabaseWarning, match=f"corrupt .*{why}"):
        assert [r.key for r in again.records()] == [good.key]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r.key for r in again.records()] == [good.key]  # removed
        assert again.lookup(ELEMENTWISE, "good", H100).micros == 2.0


def test_a_newer_stof_ccs_database_and_rows_are_left_for_it(tmp_path: Path):
    """A file whose records table has our columns and more, or rows of a newer schema, was written by a
    newer stof-cc: not moved aside nor removed (its records were lost to the version that wrote them)."""
    path = tmp_path / "t.sqlite"
    db = TuningDatabase(path)
    newer = db.store(ELEMENTWISE, "newer", H100, {"threads": 128, "vec": 1}, 2.0)
    good = db.store(ELEMENTWISE, "good", H100, {"threads": 128, "vec": 1}, 2.0)
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("UPDATE records SET schema = 2 WHERE key = ?", (newer.key,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r.key for r in db.records()] == [good.key]  # skipped, quietly
    assert raw.execute("SELECT count(*) FROM records").fetchone()[0] == 2  # and kept
    raw.execute("ALTER TABLE records ADD COLUMN arch_features TEXT")
    with pytest.warns(TuningDatabaseWarning, match="written by a newer stof-cc .*arch_features"):
        older = TuningDatabase(path)
    assert older.lookup(ELEMENTWISE, "good", H100).micros == 2.0  # read as ours
    with pytest.warns(TuningDatabaseWarning, match="written by a newer stof-cc .*not saved"):
        older.store(ELEMENTWISE, "mine", H100, {"threads": 128, "vec": 1}, 3.0)  # never written into
    assert raw.execute("SELECT count(*) FROM records").fetchone()[0] == 2
    assert not list(tmp_path.glob("*.corrupt-*"))  # left where it was
    # the command line lists it (it told the user to move it aside: found by review) and will not clear it
    from stof_cc.cli import main
    assert main(["cache", "list", "--db", str(path)]) == 0
    assert main(["cache", "clear", "--db", str(path)]) == 2
    assert raw.execute("SELECT count(*) FROM records").fetchone()[0] == 2


def _make_read_only(monkeypatch: pytest.MonkeyPatch, *paths: Path) -> None:
    """chmod ``paths`` read-only; for root, whom chmod does not stop, os.access then still says
    writable, so make it say read-only for these paths (SQLite's own read-only mode does the rest)."""
    for path in paths:
        path.chmod(0o555 if path.is_dir() else 0o444)
    real = os.access
    if any(real(path, os.W_OK) for path in paths):
        monkeypatch.setattr(os, "access", lambda path, mode, *args, **kwargs: not (
            mode & os.W_OK and Path(path) in paths) and real(path, mode, *args, **kwargs))


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_read_only_database_is_read_and_never_written(tmp_path: Path, monkeypatch, what: str):
    folder = tmp_path / "ro"
    path = folder / "t.sqlite"
    db = TuningDatabase(path)
    db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    db.close()  # the last connection: -wal and -shm are gone
    _make_read_only(monkeypatch, path if what == "file" else folder)
    before = sorted(p.name for p in folder.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        db = TuningDatabase(path)
        assert db.read_only and db.lookup(ELEMENTWISE, "sig", H100).micros == 2.0
        assert [r.signature for r in db.records()] == ["sig"]
    with pytest.warns(TuningDatabaseWarning) as caught:
        db.store(ELEMENTWISE, "other", H100, {"threads": 128, "vec": 1}, 3.0)
    assert [str(w.message) for w in caught] == [
        f"tuning database {path} is read-only; the record was not saved (it will be measured again next time)"]
    with pytest.warns(TuningDatabaseWarning, match="is read-only; nothing was cleared"):
        assert db.clear() is None  # not "0 removed": the CLI then says nothing was cleared
    assert db.lookup(ELEMENTWISE, "other", H100) is None and db.lookup(ELEMENTWISE, "sig", H100).micros == 2.0
    if what == "folder":  # nothing created in it: no -shm, no -wal, nothing moved aside
        assert sorted(p.name for p in folder.iterdir()) == before
        with pytest.raises(TuningDatabaseError, match=f"{folder / 'new.sqlite'} cannot be created: the folder "
                                                      f"{folder} is read-only"):
            TuningDatabase(folder / "new.sqlite")


def test_an_unreadable_read_only_file_is_left_in_place(tmp_path: Path, monkeypatch):
    path = tmp_path / "t.sqlite"
    path.write_bytes(b"this is not sqlite at all" * 100)
    _make_read_only(monkeypatch, path)
    with pytest.warns(TuningDatabaseWarning, match="is unreadable .*could not be moved aside"):
        db = TuningDatabase(path)
    with pytest.warns(TuningDatabaseWarning, match="is unreadable"):
        assert db.lookup(ELEMENTWISE, "sig", H100) is None
    with pytest.warns(TuningDatabaseWarning, match="is read-only|is unreadable"):
        db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    assert path.read_bytes() == b"this is not sqlite at all" * 100 and not _corrupt_files(tmp_path)


def test_a_database_deleted_while_open_is_reopened_with_a_warning(tmp_path: Path):
    """Records stored after the file was deleted went into the unlinked file, lost to every later
    open, without a word (issue 32, item 4)."""
    path = tmp_path / "t.sqlite"
    db = TuningDatabase(path)
    db.store(ELEMENTWISE, "before", H100, {"threads": 128, "vec": 1}, 1.0)
    path.unlink()  # as `rm`: the -wal and -shm stay behind
    with pytest.warns(TuningDatabaseWarning, match=f"{path} was deleted or moved away while open; reopening"):
        db.store(ELEMENTWISE, "after", H100, {"threads": 128, "vec": 1}, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reopened once: quiet from then on
        db.store(ELEMENTWISE, "later", H100, {"threads": 128, "vec": 1}, 3.0)
        assert [r.signature for r in TuningDatabase(path).records()] == ["after", "later"]


def test_a_database_replaced_while_open_is_reopened_with_a_warning(tmp_path: Path):
    path, other = tmp_path / "t.sqlite", tmp_path / "other.sqlite"
    db = TuningDatabase(path)
    db.store(ELEMENTWISE, "mine", H100, {"threads": 128, "vec": 1}, 1.0)
    theirs = TuningDatabase(other)
    theirs.store(ELEMENTWISE, "theirs", H100, {"threads": 256, "vec": 2}, 2.0)
    theirs.close()
    os.replace(other, path)
    with pytest.warns(TuningDatabaseWarning, match=f"{path} was replaced by another file while open; reopening"):
        assert db.lookup(ELEMENTWISE, "theirs", H100).micros == 2.0
    db.store(ELEMENTWISE, "new", H100, {"threads": 128, "vec": 1}, 3.0)
    assert [r.signature for r in TuningDatabase(path).records()] == ["new", "theirs"]


def test_a_path_of_the_wrong_type_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="tuning database must be a file path or None, got int"):
        TuningDatabase(12345)


def test_the_database_argument_is_checked_without_touching_the_disk(tmp_path: Path):
    from stof_cc.tune.database import check_database_argument

    (tmp_path / "notes.txt").write_text("mine")
    for fine in (None, tmp_path / "new" / "deeper" / "t.sqlite", str(tmp_path / "notes.txt")):
        check_database_argument(fine, "database")
    assert sorted(tmp_path.iterdir()) == [tmp_path / "notes.txt"]  # no folder made
    with pytest.raises(TypeError, match="^database must be a TuningDatabase, a file path or None, got float$"):
        check_database_argument(1.5, "database")
    with pytest.raises(TuningDatabaseError, match="^database: the path is empty"):
        check_database_argument("", "database")


def _listing_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Paths `cache list` must refuse, each with the error it gives."""
    (tmp_path / "notes.txt").write_text("my notes, not a database\n" * 200)
    other = sqlite3.connect(tmp_path / "other.sqlite")
    other.execute("CREATE TABLE things (x)")
    other.commit()
    other.close()
    foreign = tmp_path / "foreign.sqlite"
    _filled(foreign)
    _foreign(foreign)
    return {"not sqlite": (tmp_path / "notes.txt",
                           f"{tmp_path / 'notes.txt'} is not a tuning database (file is not a database)"),
            "another tool's": (tmp_path / "other.sqlite",
                               f"{tmp_path / 'other.sqlite'} is not a tuning database (it has no records table)"),
            "foreign layout": (foreign, f"{foreign} is not a tuning database (a records table of another layout: "
                                        "id, name)")}


@pytest.mark.parametrize("case", ["not sqlite", "another tool's", "foreign layout"])
def test_cache_list_refuses_what_is_not_a_tuning_database_and_changes_nothing(tmp_path: Path, capsys, case: str):
    """`cache list --db no/such/dir/t.sqlite` made the folders and an empty database, and
    `--db notes.txt` renamed the user's file aside (issue 32, item 11)."""
    from stof_cc.cli import main

    path, message = _listing_cases(tmp_path)[case]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["cache", "list", "--db", str(path)]) == 2
    assert capsys.readouterr().err == (f"stof-cc: error: {message}; stof-cc leaves such a file as it is: move it "
                                       "aside or remove it, or name another file (--db)\n")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*")} == before


@pytest.mark.parametrize("damage", ["pages", "cut short"])
def test_cache_list_says_a_damaged_database_is_damaged_and_clear_moves_it_aside(tmp_path: Path, capsys, damage):
    """`cache list` printed "0 record(s)" for a database with damaged pages (and a warning that it
    "could not be moved aside", which a listing never does), and called one cut short "not a
    tuning database", which `cache clear` then refused, though the library moves such a file aside
    (found by review)."""
    from stof_cc.cli import main

    path = tmp_path / "t.sqlite"
    _filled(path)
    if damage == "pages":
        _malform(path)
    else:
        path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    before = path.read_bytes()
    assert main(["cache", "list", "--db", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"stof-cc: error: {path} is damaged (database disk image is malformed): its records cannot be listed; "
        "`stof-cc cache clear` or the next tuned compile moves it aside (to t.sqlite.corrupt-<time>-<pid>) and "
        "starts an empty one (--db)\n")
    assert path.read_bytes() == before
    with pytest.warns(TuningDatabaseWarning, match="is unreadable .*; moved to .*t.sqlite.corrupt-"):
        assert main(["cache", "clear", "--db", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: removed 0 record(s)\n"
    (aside,) = tmp_path.glob("t.sqlite.corrupt-*")
    assert aside.read_bytes() == before  # kept as it was, beside a fresh database
    assert TuningDatabase(path).records() == []


def test_cache_list_of_no_database_yet_lists_nothing_and_creates_nothing(tmp_path: Path, capsys):
    """A fresh install has no database until its first tuned compile: that is 0 records, not an
    error (it was rc 2, which read as a failure to a newcomer)."""
    from stof_cc.cli import main

    missing = tmp_path / "no" / "such" / "dir" / "t.sqlite"
    assert main(["cache", "list", "--db", str(missing)]) == 0
    assert capsys.readouterr().out == f"{missing} (--db): no tuning database there yet, 0 records (a tuned " \
                                      "compile or `stof-cc tune` makes it)\n"
    assert list(tmp_path.iterdir()) == []


def test_cache_commands_read_an_empty_file_as_no_records_as_the_library_does(tmp_path: Path, capsys):
    """A 0-byte file is an SQLite database with no table: the library opens it and fills it, so
    `cache list` and `cache clear` read 0 records there (they refused it as not a tuning database)."""
    from stof_cc.cli import main

    empty = tmp_path / "t.sqlite"
    empty.touch()
    assert main(["cache", "list", "--db", str(empty)]) == 0
    assert capsys.readouterr().out == f"{empty}: 0 record(s)\n"
    assert empty.read_bytes() == b""  # a listing writes nothing
    assert main(["cache", "clear", "--db", str(empty)]) == 0
    assert capsys.readouterr().out == f"{empty}: removed 0 record(s)\n"
    assert TuningDatabase(empty).records() == []


def test_cache_list_reads_a_database_in_use_and_creates_nothing(tmp_path: Path, capsys):
    from stof_cc.cli import main

    path = tmp_path / "t.sqlite"
    _filled(path)  # closed: no -wal, no -shm
    assert main(["cache", "list", "--db", str(path)]) == 0
    assert "100 record(s)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.sqlite"]
    writer = TuningDatabase(path)  # open, with a record only in its WAL: the listing reads it there
    writer.store(ELEMENTWISE, "in the wal", H100, {"threads": 128, "vec": 1}, 1.0)
    assert main(["cache", "list", "--db", str(path)]) == 0
    assert "101 record(s)" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["not sqlite", "another tool's", "foreign layout"])
def test_cache_clear_touches_only_a_tuning_database(tmp_path: Path, capsys, case: str):
    """`cache clear --db notes.txt` renamed the user's file aside and made an empty database in
    its place (noticed in an earlier session): now it refuses, and a missing one is nothing to clear."""
    from stof_cc.cli import main

    path, message = _listing_cases(tmp_path)[case]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code = main(["cache", "clear", "--db", str(path)])
    captured = capsys.readouterr()
    if case == "missing":
        assert code == 0 and "nothing to clear" in captured.out and not path.parent.exists()
    else:
        assert code == 2 and captured.err.startswith(f"stof-cc: error: {message}; ") and "move it aside" in captured.err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_cache_clear_of_a_read_only_database_fails_and_says_so(tmp_path: Path, monkeypatch, capsys):
    """It printed "removed 0 record(s)" and exited 0, the record still there (found by review)."""
    from stof_cc.cli import main

    path = tmp_path / "t.sqlite"
    db = TuningDatabase(path)
    db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    db.close()
    _make_read_only(monkeypatch, path)
    with pytest.warns(TuningDatabaseWarning, match="read-only; nothing was cleared"):
        assert main(["cache", "clear", "--db", str(path)]) == 2
    assert "nothing was cleared" in capsys.readouterr().err
    assert TuningDatabase(path, read_only=True).lookup(ELEMENTWISE, "sig", H100).micros == 2.0


def test_a_corrupt_row_read_earlier_never_removes_the_good_record_stored_under_its_key_since(tmp_path: Path):
    """A rank read a corrupt row, another stored a good record under the same key, then the first removed
    every row of the key: the good record was lost (found by review)."""
    db = TuningDatabase(tmp_path / "t.sqlite")
    db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    (good,) = db._db.execute("SELECT * FROM records").fetchall()
    read_before = (good[0], good[1], good[2], good[3], "{not json", good[5], good[6], good[7])
    with pytest.warns(TuningDatabaseWarning, match="is corrupt"):
        assert db._trusted(read_before) is None
    assert db.lookup(ELEMENTWISE, "sig", H100).micros == 2.0


def test_a_record_whose_parameters_nest_too_deeply_is_skipped_not_a_crash(tmp_path: Path):
    db = TuningDatabase(tmp_path / "t.sqlite")
    db.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    db._db.execute("UPDATE records SET params = ?", ("[" * 100000 + "]" * 100000,))
    with pytest.warns(TuningDatabaseWarning, match="nest too deeply"):
        assert db.lookup(ELEMENTWISE, "sig", H100) is None


def test_a_file_moved_aside_while_this_process_opened_it_is_not_taken_for_the_fresh_one(tmp_path: Path, monkeypatch):
    """A rank opened the damaged file, another moved it aside and started a fresh one before the first
    took the file's identity: the first then moved the fresh, good file aside (found by review)."""
    import stof_cc.tune.database as database

    path = tmp_path / "t.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    fresh = tmp_path / "fresh.sqlite"
    seed = TuningDatabase(fresh)
    seed.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    seed.close()  # the last connection: its -wal and -shm are gone, and the file moves alone
    real, calls = sqlite3.connect, []

    def connect_then_swap(*args, **kwargs):  # the other rank acts between this open and its stat
        connection = real(*args, **kwargs)
        if not calls:
            os.replace(path, tmp_path / "t.sqlite.corrupt-0-1")
            os.replace(fresh, path)
        calls.append(1)
        return connection

    monkeypatch.setattr(database.sqlite3, "connect", connect_then_swap)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is unreadable, nothing moved
        db = TuningDatabase(path)
        assert db.lookup(ELEMENTWISE, "sig", H100).micros == 2.0
    assert len(calls) == 2 and _corrupt_files(tmp_path) == [tmp_path / "t.sqlite.corrupt-0-1"]


def test_a_listing_opened_before_a_writer_changed_the_file_reads_it_again_not_damaged(tmp_path: Path):
    """A listing opens a file no writer has open immutable; a rank then wrote and checkpointed, the listing read
    pages of two versions, called the healthy file damaged and advised `cache clear` (found by review)."""
    from stof_cc.tune.database import DamagedDatabaseError

    path = tmp_path / "t.sqlite"
    first = TuningDatabase(path)
    first.store(ELEMENTWISE, "sig", H100, {"threads": 128, "vec": 1}, 2.0)
    first.close()  # no writer has it open: a listing opens it immutable
    listing = TuningDatabase(path, read_only=True)
    writer = TuningDatabase(path)
    for index in range(3000):
        writer.store(ELEMENTWISE, f"sig{index}", H100, {"threads": 128, "vec": 1}, 2.0)
    writer.close()
    try:
        records = listing.records(strict=True)
    except DamagedDatabaseError as exc:
        pytest.fail(f"a healthy file called damaged: {exc}")
    assert len(records) == 3001
