"""The README and the docs name only files that exist, their links land on real headings, and
the README stays readable (no line over 200 characters). CPU only, no imports of stof_cc."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]
# where a repository path may start: the top-level entries and stof_cc's subpackages (docs write
# `runtime/build.py` for `stof_cc/runtime/build.py`)
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".git")} | {".ci"}
PACKAGES = {p.name for p in (ROOT / "stof_cc").iterdir() if p.is_dir() and not p.name.startswith("__")}
GENERATED = ("stof_build/", ".venv/")  # written by the commands, not in the repository
SKIPPED_DIRS = {".git", ".venv", "stof_build", "node_modules", "__pycache__"}
MARKDOWN_NAMES = {p.name for p in ROOT.rglob("*.md") if not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)}

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
COMMAND_PATH = re.compile(r"(?<![\w/.~$-])((?:examples|benchmarks|tests|stof_cc|docs)/[\w./-]*[\w/])")
MARKDOWN_WORD = re.compile(r"(?<![\w/.~$-])([\w./-]*[\w-]\.md)\b")


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def _fenced(text: str) -> str:
    return "\n".join(m.group(0) for m in FENCE.finditer(text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in _prose(page.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*)", line):
            slug, n = _slug(match.group(1)), 1
            while (slug if n == 1 else f"{slug}-{n - 1}") in found:
                n += 1
            found.add(slug if n == 1 else f"{slug}-{n - 1}")
    return found


def _exists(page: Path, path: str) -> bool:
    path = path.rstrip("/") or "."
    return any((base / path).exists() for base in (ROOT, page.parent, ROOT / "stof_cc"))


def _repository_path(token: str) -> str | None:
    """The repository path an inline code span names, or None when it names none (a command, an
    expression, a generated or outside file)."""
    if any(c in token for c in " <>$~*=,()[]{}'\"") or token.startswith(("/", "../", "http")):
        return None
    token = token.split("#")[0].split(":")[0]
    if not token or token.startswith(GENERATED):
        return None
    if "/" in token:
        first = token.split("/")[0]
        return token if first in TOP | PACKAGES or first.startswith(".") else None  # .ci/, .runs/...
    return token if token.endswith(".md") else None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_at_files_and_headings_that_exist(page: Path):
    missing = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            missing.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            missing.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert not missing, f"{page.relative_to(ROOT)}:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_backticked_paths_exist(page: Path):
    text = page.read_text()
    named = {p for token in CODE.findall(_prose(text)) if (p := _repository_path(token))}
    named |= set(COMMAND_PATH.findall(_fenced(text)))  # `python benchmarks/mha.py` in a code block
    missing = sorted(p for p in named
                     if not (_exists(page, p) or ("/" not in p and p in MARKDOWN_NAMES)))
    assert not missing, f"{page.relative_to(ROOT)} names paths the repository does not have: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_files_named_in_prose_exist(page: Path):
    """`DESIGN.md`, `WORKLOADS.md`...: a page named in running text is a page of this repository."""
    missing = sorted({name for name in MARKDOWN_WORD.findall(_prose(page.read_text()))
                      if not (_exists(page, name) or ("/" not in name and name in MARKDOWN_NAMES))})
    assert not missing, f"{page.relative_to(ROOT)} names markdown files the repository does not have: {missing}"


def test_no_readme_line_is_over_200_characters():
    long = [(n, len(line)) for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
            if len(line) > 200]
    assert not long, f"README.md lines over 200 characters (line, length): {long}"


def test_the_checks_catch_what_they_are_for(tmp_path: Path):
    """The helpers flag a missing file, a missing anchor and a stray page name, and let through
    commands, generated paths and outside files."""
    assert _repository_path("stof_cc/tune/cost_model.py") == "stof_cc/tune/cost_model.py"
    assert _repository_path("examples/tiny_bert.py:factory") == "examples/tiny_bert.py"
    assert _repository_path("docs/decisions.md#cuda-graphs") == "docs/decisions.md"
    assert _repository_path(".ci/run") == ".ci/run" and _repository_path(".runs/ab.py") == ".runs/ab.py"
    assert _repository_path("DESIGN.md") == "DESIGN.md" and "DESIGN.md" not in MARKDOWN_NAMES
    for not_a_path in ("stof_build/<model>/g0.cu", "~/.cache/stof-cc/cubin", "$STOF_CC_CACHE/cubin",
                       "triton/backends/amd/compiler.py", "fp16/bf16", "stof-cc inspect", "q[:, :, r::d]"):
        assert _repository_path(not_a_path) is None, not_a_path
    assert _slug("Real models: `benchmarks/models.py`") == "real-models-benchmarksmodelspy"
    assert _slug("Long context: S = 32768 and 131072") == "long-context-s--32768-and-131072"
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n## A heading\n")
    assert _anchors(page) == {"a-heading", "a-heading-1"}
    assert MARKDOWN_WORD.findall("see DESIGN.md and docs/ir.md.") == ["DESIGN.md", "docs/ir.md"]


def test_the_pipeline_page_lists_the_passes_that_run():
    from stof_cc.passes.lower import pipeline_text

    assert f"```\n{pipeline_text()}\n```" in (ROOT / "docs" / "pipeline.md").read_text()


def test_the_attention_pages_sample_output_is_what_the_command_prints(capsys, monkeypatch):
    """docs/attention.md shows `stof-cc attention`'s output; it drifted from the code after the cost
    model's refit (found by a newcomer's read): its chosen and first candidate lines must be printed."""
    from stof_cc.cli import main

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["attention", "--mask", "sliding:w=256", "--seq", "4096", "--head-dim", "32"]) == 0
    printed = capsys.readouterr().out.splitlines()
    page = (ROOT / "docs" / "attention.md").read_text()
    chosen = next(line for line in printed if line.startswith("chosen: "))
    first = printed[printed.index("candidates (best first):") + 1]
    assert chosen in page and first in page, (chosen, first)
