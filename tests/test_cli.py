"""The stof-cc command line: inspect lists ops with their kinds and writes a .dot file."""

from __future__ import annotations

import argparse
import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stof_cc
import stof_cc.cli
from stof_cc.cli import build_parser, main


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
    if "assert_metadata" in rows:  # the table's kind "opaque" for them is told apart from real opaque ops
        assert "trace-time checks (assert_metadata, dropped by canonicalize): " in out
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


def test_attention_command_explains_the_choice(capsys):
    assert main(["attention", "--mask", "longformer:w=128,g=32", "--seq", "2048", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "chosen: attention_" in out and "candidates (best first)" in out and "longformer" in out


def test_attention_command_bad_mask_is_a_clear_error(capsys):
    assert main(["attention", "--mask", "sliding:w=0", "--seq", "256"]) == 2
    assert "sliding_window: w must be a positive int" in capsys.readouterr().err


def test_inspect_shows_the_kernel_for_causal_sdpa(tmp_path, capsys):
    model = tmp_path / "causal_sdpa.py"
    model.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, q, k, v):\n"
        "        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "def factory():\n"
        "    return M(), tuple(torch.randn(1, 2, 256, 64) for _ in range(3))\n"
    )
    assert main(["inspect", f"{model}:factory", "--quiet-graph", "--build-dir", str(tmp_path / "b")]) == 0
    assert re.search(r"attention kernel (rowwise|blockwise|wgmma|wgmma_ws) m\d+ n\d+", capsys.readouterr().out)


@pytest.mark.nvcc
def test_attention_command_writes_and_compiles_the_chosen_kernel(tmp_path, capsys):
    assert main(["attention", "--mask", "causal", "--seq", "1024", "--build-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    written = list((tmp_path / "attention").glob("stof_attn_*.cu"))
    assert len(written) == 1 and f"wrote {written[0]}" in out
    assert re.search(r"nvcc sm_90a?: \d+ registers, 0 bytes spilled", out)


def test_inspect_canonicalize_reports_and_checks(example_path, tmp_path, capsys):
    code = main(["inspect", example_path("tiny_bert"), "--quiet-graph", "--check", "--passes",
                 "--build-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "nodes folded to constants" in out and "-> OK" in out
    assert "dropout" not in out.split("opaque ops")[0]


def test_inspect_check_says_a_mask_given_is_not_what_it_checks(example_path, tmp_path, capsys):
    """--check compares the graph as traced; with --mask it read OK as if the mask were checked (a
    newcomer's reading)."""
    code = main(["inspect", example_path("tiny_bert"), "--quiet-graph", "--check", "--mask", "sliding:w=2",
                 "--build-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "--mask is not applied to it" in out and "-> OK" in out


@pytest.mark.nvcc
def test_compile_writes_and_compiles_group_kernels(example_path, tmp_path, capsys):
    assert main(["compile", example_path("encoder_layer"), "--build-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gemm_epilogue" in out and "row_reduce" in out and "2 alternative(s)" in out
    # stage 1 weighs the one-kernel GEMM + LayerNorm against the two kernels; at this size apart wins
    assert re.search(r"linear_3 \+ layer_norm \(row 128\): kept apart \(merged [\d.]+ us estimated against [\d.]+ us apart\)", out)
    assert "a boolean mask tensor that is not key padding" in out  # the attention group says why torch runs it
    assert "6 of 7 groups generated, all compiled with nvcc for sm_90" in out  # Q, K, V: one GEMM
    build = tmp_path / "encoder_layer"
    sources = sorted(build.glob("*.cu"))
    assert len(sources) == 6 and all(p.read_text().startswith("// stof-cc fusion group") for p in sources)
    index = (build / "index.html").read_text()
    assert index.count('<a href="g') == 6 and "fusion.svg" in index and "not tuned" in index
    svg = (build / "fusion.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 22  # one box per computed node of the layer


@pytest.mark.parametrize("command", [
    ["inspect", "{tiny_bert}", "--quiet-graph", "--build-dir", "{file}/build"],
    ["compile", "{gpt2_block}", "--no-nvcc", "--build-dir", "{file}/build"],
    ["attention", "--mask", "causal", "--seq", "256", "--build-dir", "{file}/build"],
    ["masks", "show", "causal", "--seq", "64", "--out", "{file}/mask.png"],
])
def test_an_output_path_under_a_file_is_a_clear_error(command, example_path, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    names = {"file": blocker, "tiny_bert": example_path("tiny_bert"), "gpt2_block": example_path("gpt2_block")}
    assert main([part.format(**names) for part in command]) == 2
    assert f"{blocker} is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["{file}/t.sqlite", "{folder}", ""])
def test_a_database_path_that_cannot_hold_one_is_a_clear_error(where, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    folder = tmp_path / "cubin_cache"
    folder.mkdir()
    for action in ("list", "clear"):
        assert main(["cache", action, "--db", where.format(file=blocker, folder=folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("stof-cc: error: ") and "Traceback" not in err and "STOF_CC_TUNING_DB" in err
    assert folder.is_dir() and not list(tmp_path.glob("*.corrupt-*"))  # nothing moved aside


@pytest.mark.parametrize(("source", "cause"), [
    ("import torch\ndef factory(:\n    pass\n", "{file} does not load: SyntaxError: invalid syntax (line 2)"),
    ("import torch\nimport no_such_module_for_stof\n",
     "{file} does not load: ModuleNotFoundError: No module named 'no_such_module_for_stof' (line 2)"),
    ("import torch\nraise RuntimeError('the model zoo is offline')\n",
     "{file} does not load: RuntimeError: the model zoo is offline (line 2)"),
    ("import json\n\ndef factory():\n    return json.loads('{not json')\n",  # the line is the user's, not json's
     "{file}:factory raised JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1) (line 4)"),
], ids=["syntax error", "failed import", "raises on import", "factory raises"])
def test_a_factory_file_that_fails_is_one_error_line(source, cause, tmp_path, capsys):
    """A raw traceback before (issue 32, item 13): now one line naming the file, the line and the cause."""
    script = tmp_path / "model.py"
    script.write_text(source)
    for command in ("inspect", "compile", "tune"):  # tune loads the model before it asks for a GPU
        assert main([command, f"{script}:factory"]) == 2
        assert capsys.readouterr().err == f"stof-cc: error: {cause.format(file=script)}\n"


def test_a_model_file_imports_beside_itself_and_one_that_exits_is_named(tmp_path, capsys):
    """A model file importing a module in its own folder failed (the folder was not on sys.path,
    where `python FILE.py` puts it); a file that parses sys.argv or exits as it is imported printed
    argparse's usage under stof-cc's name, or only the exit message (a helper's audit)."""
    (tmp_path / "mymodel.py").write_text("import torch\nclass Net(torch.nn.Linear):\n    pass\n")
    script = tmp_path / "uses_sibling.py"
    script.write_text("import torch\nfrom mymodel import Net\n\n"
                      "def factory():\n    return Net(8, 8), (torch.randn(2, 8),)\n")
    assert main(["inspect", f"{script}:factory", "--quiet-graph", "--build-dir", str(tmp_path / "b")]) == 0
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit('bye')\n")
    assert main(["inspect", f"{exits}:factory"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stof-cc: error: {exits} does not load: SystemExit: bye (line 2)") and "__main__" in err


def test_inspect_check_names_a_model_that_fails_on_its_own_inputs(tmp_path, capsys):
    """`inspect --check` ended in torch's traceback when the eager model itself failed (an
    embedding given an id past its table): one error line now (a helper's audit)."""
    script = tmp_path / "bad_ids.py"
    script.write_text("import torch\n\ndef factory():\n"
                      "    return torch.nn.Embedding(10, 8), (torch.tensor([1, 2, 11]),)\n")
    assert main(["inspect", f"{script}:factory", "--quiet-graph", "--check", "--build-dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "stof-cc: error: the model fails on its own example inputs, run eagerly in torch: IndexError" in err
    assert "Traceback" not in err


def _write_escaping_factory(folder: Path) -> Path:
    """A model file whose factory is named ``../../../escape`` (a module attribute, not a def)."""
    script = folder / "f.py"
    script.write_text("import torch\n\n"
                      "def factory():\n"
                      "    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()), (torch.randn(16, 64),)\n\n"
                      "globals()['../../../escape'] = factory\n")
    return script


def test_a_factory_name_never_leads_outside_the_build_dir(tmp_path, capsys):
    """`stof-cc compile 'f.py:../../../escape' --build-dir x/y/bd` wrote the .cu files, index.html
    and fusion.* beside the build folder's parents (issue 32, item 5)."""
    script = _write_escaping_factory(tmp_path)
    build = tmp_path / "x" / "y" / "bd"
    assert main(["compile", f"{script}:../../../escape", "--no-nvcc", "--build-dir", str(build)]) == 0
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != script]
    names = {p.name for p in written}
    assert {"g0.cu", "index.html", "fusion.svg"} <= names and all(p.is_relative_to(build) for p in written), written
    assert main(["inspect", f"{script}:../../../escape", "--quiet-graph", "--build-dir", str(build)]) == 0
    assert all(p.is_relative_to(build) for p in tmp_path.rglob("*") if p.is_file() and p != script)


def test_a_reused_build_dir_holds_only_this_builds_group_sources(tmp_path, capsys):
    """A group source an earlier build left (g7.cu, from a plan with more groups) was read as this
    build's kernel; the user's own files stay."""
    script = _write_escaping_factory(tmp_path)
    build = tmp_path / "bd"
    (build / "f").mkdir(parents=True)
    (build / "f" / "g7.cu").write_text("// an earlier build's group\n")
    (build / "f" / "notes.cu").write_text("// mine\n")
    assert main(["compile", f"{script}:factory", "--no-nvcc", "--build-dir", str(build)]) == 0
    assert (build / "f" / "g0.cu").is_file() and (build / "f" / "notes.cu").is_file()
    assert not (build / "f" / "g7.cu").exists()


def test_a_build_dir_name_too_long_is_a_clear_error(tmp_path, capsys):
    """The OS error handler itself raised (Path.is_file on a name too long): a raw traceback."""
    script = _write_escaping_factory(tmp_path)
    build = tmp_path / ("b" * 300)
    assert main(["compile", f"{script}:factory", "--no-nvcc", "--build-dir", str(build)]) == 2
    assert capsys.readouterr().err == f"stof-cc: error: cannot write {build / 'f'}: File name too long\n"


@pytest.mark.parametrize("error", [errno.ENAMETOOLONG, errno.EACCES])
def test_describing_an_os_error_never_raises(error, tmp_path, monkeypatch):
    from stof_cc.cli import describe_os_error

    path = tmp_path / ("n" * 300 if error == errno.ENAMETOOLONG else "locked") / "out.png"
    real_stat = os.stat

    def stat(target, *args, **kwargs):  # root reads through chmod: refuse as a locked folder would
        if error == errno.EACCES and "locked" in str(target):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(target))
        return real_stat(target, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    exc = OSError(error, os.strerror(error), str(path))
    assert describe_os_error(exc) == f"cannot write {path}: {os.strerror(error)}"


def _parsers(parser: argparse.ArgumentParser, name: str = "stof-cc"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {command}")


def test_every_command_and_option_has_help():
    """`stof-cc attention --batch/--heads/--head-dim` had none."""
    missing = []
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {choice.dest for choice in action._choices_actions if choice.help}
                missing += [f"{name} {command}" for command in action.choices if command not in helped]
            elif not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"no help text: {missing}"
    assert {"stof-cc attention", "stof-cc masks show"} <= {name for name, _ in _parsers(build_parser())}


@pytest.mark.parametrize("nvcc", ["/opt/cuda/bin/nvcc", None])
def test_version_names_stof_cc_torch_and_nvcc(nvcc, monkeypatch, capsys):
    monkeypatch.setattr(stof_cc.cli, "nvcc_path", lambda: nvcc)
    monkeypatch.setattr(stof_cc.cli, "nvcc_version", lambda: "12.9")
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    lines = capsys.readouterr().out.splitlines()
    assert exited.value.code == 0 and lines[:2] == [f"stof-cc {stof_cc.__version__}", f"torch {torch.__version__} "
                                                    f"({f'CUDA {torch.version.cuda}' if torch.version.cuda else 'CPU only'})"]
    assert lines[2] == ("nvcc 12.9 (/opt/cuda/bin/nvcc)" if nvcc else "nvcc not found")


@pytest.mark.parametrize(("command", "line"), [
    (["compile", "{tiny_bert}", "--no-nvcc"], "no GPU visible: generating for sm_90 (H100, 132 SMs)"),
    (["attention", "--mask", "causal", "--seq", "512"], "no GPU visible: choosing the kernel for sm_90 (H100, 132 SMs)"),
    (["inspect", "{tiny_bert}", "--quiet-graph", "--passes"],
     "no GPU visible: choosing attention kernels for sm_90 (H100, 132 SMs)"),
])
def test_without_a_gpu_the_assumed_one_is_said_once(command, line, example_path, tmp_path, monkeypatch, capsys):
    """`stof-cc compile` assumed sm_90 silently where no GPU is visible."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    build = ["--build-dir", str(tmp_path)] if command[0] != "attention" else []
    assert main([part.format(tiny_bert=example_path("tiny_bert")) for part in command] + build) == 0
    assert capsys.readouterr().out.splitlines().count(line) == 1


def test_attention_says_why_its_pick_differs_from_stofs_rule(monkeypatch, capsys):
    """It printed "STOF's rule ... -> blockwise" and then chose a wgmma_ws kernel without a word."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the H100's candidates and SM count
    assert main(["attention", "--mask", "sliding:w=256", "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"chosen: attention_wgmma_ws (wgmma_ws m\d+ n\d+ w\d+ s\d+[a-z ]*),", out).group(1)
    ours = re.search(rf"  {chosen}: ([\d.]+) us est", out).group(1)
    best_blockwise = re.search(r"  (blockwise m\d+ n\d+ w\d+ s\d+): ([\d.]+) us est", out)
    assert ("STOF's density rule suggests blockwise (rho=0.1248, the share of 16 x 16 blocks with an allowed element, >= tau=0.0156); the cost model picks wgmma_ws "
            f"instead:\n  estimated {ours} us against {best_blockwise.group(2)} us for the best blockwise point "
            f"({best_blockwise.group(1)})\n") in out
    assert main(["attention", "--mask", "sliding:w=256", "--seq", "4096", "--head-dim", "32"]) == 0
    out = capsys.readouterr().out  # no wgmma candidates at D = 32: the model agrees with the rule
    assert "chosen: attention_blockwise" in out and "tau=0.0156): the chosen strategy too\n" in out


def test_compile_output_fits_120_columns(example_path, tmp_path, monkeypatch, capsys):
    """`stof-cc compile examples/tiny_bert.py:factory` printed lines of up to 410 characters: the
    attention groups' fused ops twice, and refusals from templates that never could apply."""
    monkeypatch.chdir(tmp_path)  # the default build folder, as a user runs it
    assert main(["compile", example_path("tiny_bert")]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120, out
    assert out.count("reshape_permute") == 1 and out.count("the other fused ops stay torch views") == 2
    assert "not an overflow_clamp" not in out
    assert all("views only" in line for line in out.splitlines() if line.strip().startswith("torch:")), out
    assert main(["compile", example_path("tiny_bert"), "--why"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120, out
    assert "--why adds" not in out


def test_a_reader_that_goes_away_is_not_an_error(example_path):
    """`stof-cc inspect ... | head -1`: no error line when the pipe closes."""
    command = [sys.executable, "-m", "stof_cc.cli", "inspect", example_path("tiny_bert")]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout.readline().startswith(b"graph tiny_bert")
        process.stdout.close()  # as head does after its line
        errors = process.stderr.read().decode()
        process.wait(timeout=120)
    assert "error" not in errors, errors


def test_compile_with_a_mask_generates_the_attention_a_runtime_mask_kept_in_torch(tmp_path, capsys):
    """A newcomer's review: the encoder layer's boolean mask tensor kept its attention in torch, and the
    message's remedy (a description) had no form on the command line. `--mask SPEC` is that form."""
    from stof_cc.cli import main

    assert main(["compile", "examples/encoder_layer.py:factory", "--no-nvcc", "--build-dir", str(tmp_path)]) == 0
    without = capsys.readouterr().out
    assert "--mask SPEC" in without
    assert main(["compile", "examples/encoder_layer.py:factory", "--no-nvcc", "--build-dir", str(tmp_path),
                 "--mask", "sliding:w=64"]) == 0
    out = capsys.readouterr().out
    assert "--mask: sliding_window(w=64) replaces the own mask of 1 attention node(s)" in out  # said, not silent
    attention_rows = [line for line in out.splitlines() if " attention " in line and not line.startswith("--mask")]
    assert attention_rows and "attention_" in attention_rows[0] and ".cu" in attention_rows[0], attention_rows
    assert main(["inspect", "examples/encoder_layer.py:factory", "--quiet-graph", "--build-dir", str(tmp_path),
                 "--mask", "causal & ~sliding:w=8"]) == 0
    assert "attention kernel" in capsys.readouterr().out


def test_arch_generates_for_another_gpu_generation_and_then_lets_go(tmp_path, capsys):
    """A newcomer's review: without a GPU everything targeted sm_90, so an A100 user could not
    preview their kernels. `--arch sm_80`: attention on the mma.sync templates, GEMM groups in torch
    (the GEMM template is sm_90a), estimates at 108 SMs; the target is the visible GPU's again after."""
    from stof_cc.cli import main
    from stof_cc.templates.pricing import chosen_target, sm_count, target_capability

    before = (target_capability(), sm_count())
    assert main(["compile", "examples/encoder_layer.py:factory", "--no-nvcc", "--build-dir", str(tmp_path),
                 "--arch", "sm_80", "--mask", "causal"]) == 0
    out = capsys.readouterr().out
    assert "--arch: generating for sm_80 (A100, 108 SMs)" in out
    assert re.search(r"attention\s+scaled_dot_product_attention\s+attention_(blockwise|rowwise)\s+g1\.cu", out), out
    assert "torch: gemm_epilogue: not for compute capability 8.0" in out
    assert chosen_target() is None and (target_capability(), sm_count()) == before
    assert main(["attention", "--mask", "causal", "--seq", "256", "--arch", "sm_80", "--check"]) == 2
    assert "does not go with --arch" in capsys.readouterr().err
    assert main(["attention", "--mask", "causal", "--seq", "256", "--arch", "sm_90a"]) == 0  # nvcc's name for it
    assert "--arch: choosing the kernel for sm_90 (H100, 132 SMs)" in capsys.readouterr().out


_CHECKED = '''
import torch


class Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN at -1, in the interpreter and eagerly alike


class InUnit(torch.nn.Module):
    def forward(self, x):
        return (x > 0) & (x < 1), x[:0].softmax(-1)  # a boolean output and an empty one


def nan():
    return Log(), (torch.tensor([-1.0, 2.0]),)


def flags():
    return InUnit(), (torch.randn(4, 16),)
'''


@pytest.mark.parametrize("factory", ["nan", "flags"])
def test_inspect_check_agrees_on_nan_boolean_and_empty_outputs(tmp_path, capsys, factory):
    """--check said MISMATCH (exit 1) for outputs with NaN where eager has them, and a traceback for
    boolean or empty outputs (found by review)."""
    path = tmp_path / "checked.py"
    path.write_text(_CHECKED)
    assert main(["inspect", f"{path}:{factory}", "--quiet-graph", "--check"]) == 0
    assert "-> OK" in capsys.readouterr().out


def test_leaf_error_calls_a_shape_or_value_difference_wrong():
    from stof_cc.cli import _leaf_error

    assert _leaf_error(torch.zeros(2, 3), torch.zeros(3, 2)) == float("inf")
    assert _leaf_error(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])) == float("inf")
    assert _leaf_error(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])) == 0.5


def test_attention_check_without_a_gpu_is_not_a_success(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the check runs")
    assert main(["attention", "--mask", "causal", "--seq", "256", "--check"]) == 2
    assert "not run against the reference" in capsys.readouterr().err


def test_tune_top_k_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["tune", "model.py:factory", "--top-k", "0"])
    assert exited.value.code == 2 and "0 is not a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["compile", "examples/encoder_layer.py:factory", "--no-nvcc"],
                                     ["attention", "--seq", "128"], ["masks", "show", "causal", "--seq", "64"],
                                     ["inspect", "examples/encoder_layer.py:factory"]])
def test_an_empty_build_dir_is_an_error_in_every_command(command, capsys):
    """`--build-dir ''` wrote into the current folder in two commands and nothing in `attention`
    (a helper's audit)."""
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--build-dir", ""])
    assert exit_.value.code == 2 and "argument --build-dir: the path is empty" in capsys.readouterr().err
