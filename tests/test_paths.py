"""Names made into paths (`ir/paths.py`): one readable, bounded component each, never a way out
of the folder it is joined to (issue 32, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stof_cc.ir.paths import MAX_COMPONENT_BYTES, PathError, blocking_file, path_component, path_in


@pytest.mark.parametrize(("name", "component"), [
    ("tiny_bert", "tiny_bert"),
    ("gpt2_block_factory", "gpt2_block_factory"),
    ("Modèle-v1.2", "Modèle-v1.2"),  # readable names stay as they are
    ("../../../escaped", "_._.._.._escaped"),
    ("/etc/passwd", "_etc_passwd"),
    ("..", "_."),
    (".", "_"),
    (".hidden", "_hidden"),
    ("", "_"),
    ("a b:c*?<>\\", "a_b_c_____"),
])
def test_a_name_becomes_one_safe_readable_component(name, component):
    assert path_component(name) == component


def test_a_long_name_is_cut_and_keeps_a_hash_of_the_whole():
    one, other = "x" * 300, "x" * 299 + "y"
    assert len(path_component(one).encode()) <= MAX_COMPONENT_BYTES
    assert path_component(one).startswith("x" * 80) and path_component(one) != path_component(other)
    wide = path_component("é" * 300)  # two bytes each: cut on a character boundary
    assert len(wide.encode()) <= MAX_COMPONENT_BYTES and wide.startswith("é" * 40)


def test_path_in_joins_components_and_refuses_a_link_out(tmp_path: Path):
    build = tmp_path / "bd"
    build.mkdir()
    assert path_in(build, "../x", "g0.cu") == build / "_._x" / "g0.cu"
    (tmp_path / "elsewhere").mkdir()
    (build / "model").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PathError, match=f"{build / 'model' / 'g0.cu'} leads outside {build}"):
        path_in(build, "model", "g0.cu")


def test_blocking_file_finds_the_file_in_the_way_and_never_raises(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("")
    assert blocking_file(tmp_path / "notes.txt" / "a" / "b") == tmp_path / "notes.txt"
    assert blocking_file(tmp_path / "free" / "a") is None
    assert blocking_file(tmp_path / ("n" * 300) / "a") is None  # ENAMETOOLONG from stat: no error
