"""The stof-cc command line: inspect lists ops with their kinds and writes a .dot file."""

from __future__ import annotations

from stof_cc.cli import main


def test_inspect_tiny_bert(example_path, tmp_path, capsys):
    code = main(["inspect", example_path("tiny_bert"), "--build-dir", str(tmp_path), "--check"])
    out = capsys.readouterr().out
    assert code == 0
    assert "%linear" in out  # the graph itself
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.count(" ") > 2}
    assert rows["linear"][0] == "gemm"
    assert rows["layer_norm"][0] == "reduction"
    assert rows["softmax"][0] == "reduction"
    assert rows["gelu"][0] == "elementwise"
    assert "opaque ops (run through torch): 0" in out
    assert "-> OK" in out
    dot = tmp_path / "tiny_bert" / "graph.dot"
    assert dot.read_text().startswith('digraph "tiny_bert"')


def test_inspect_bad_reference_is_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.py") + ":factory"]) == 2
    assert "no such file" in capsys.readouterr().err
    script = tmp_path / "model.py"
    script.write_text("def factory():\n    return 3\n")
    assert main(["inspect", f"{script}:factory"]) == 2
    assert "must return (module, args)" in capsys.readouterr().err
    assert main(["inspect", f"{script}:other"]) == 2
    assert "has no function 'other'" in capsys.readouterr().err
