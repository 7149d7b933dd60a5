"""The template registry, the shared Jinja2 environment and the contract of a template.

A template is a CUDA source rendered by Jinja2 plus a Python spec (`KernelTemplate`) that
knows its parameter space, the values its source is rendered with and its launch geometry.
Rendering is pure: (problem, params) -> source text, so sources and cache keys are
deterministic.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

import jinja2

TEMPLATE_DIR = Path(__file__).resolve().parent

ProblemT = TypeVar("ProblemT")  # what a template renders from: AttentionProblem, GroupProblem
Launch = tuple[tuple[int, int, int], int, int]  # grid (x, y, z), threads per CTA, dynamic shared bytes


@functools.cache
def _environment(template_dir: Path) -> jinja2.Environment:
    """Templates in ``template_dir`` see stof-cc's own macro files too (group_common.j2, ...)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(template_dir), str(TEMPLATE_DIR)]),
        undefined=jinja2.StrictUndefined,  # a missing parameter is an error, not an empty string
        keep_trailing_newline=True,
    )


def template_file_text(template_dir: Path, name: str) -> str:
    """The text of ``name`` as a template in ``template_dir`` sees it when rendering (its own
    folder first, then stof-cc's)."""
    environment = _environment(Path(template_dir))
    source, _, _ = environment.loader.get_source(environment, name)
    return source


class KernelTemplate(ABC, Generic[ProblemT]):
    """One template: its name, source file, parameter space, render values and launch rule.

    A spec defines `space`, `kernel_name` and `launch`, and gives its source's values in
    `context`; `render` adds the values every source of its kind receives (`common_context`)."""

    name: str
    source_file: str
    template_dir: Path = TEMPLATE_DIR  # where source_file and the files it imports live
    arch_features: str = ""  # "a" for sources that need the arch-specific target (sm_90a)
    min_capability: tuple[int, int] = (0, 0)  # oldest compute capability it compiles for
    capabilities: tuple[tuple[int, int], ...] | None = None  # exactly these, when arch-specific
    # The source calls wait_for_producer_grids() (dependent_launch.j2) in every thread before its first
    # global memory access, so its kernels may be launched with programmatic dependent launch and start
    # while the kernel before them drains. Leave False unless the source really does: a PDL launch of a
    # kernel that does not wait reads its inputs before they are written.
    waits_for_producers: bool = False
    # Modules beside the spec's own that write part of its source (the group templates' chains): their
    # code is in the tuning records' key, so a changed generator is measured and checked again.
    renders_with: tuple[ModuleType, ...] = ()

    def render_source(self, **context: Any) -> str:
        """``source_file`` rendered with ``context``."""
        return _environment(Path(self.template_dir)).get_template(self.source_file).render(**context)

    def runs_on(self, capability: tuple[int, int]) -> bool:
        capability = tuple(capability)
        return capability >= self.min_capability and (self.capabilities is None or capability in self.capabilities)

    @abstractmethod
    def space(self, problem: ProblemT) -> list[dict[str, Any]]:
        """Every legal parameter point for ``problem`` (constraints already applied)."""

    @abstractmethod
    def kernel_name(self, problem: ProblemT, params: dict[str, Any]) -> str:
        """The extern "C" symbol the rendered source defines."""

    @abstractmethod
    def launch(self, problem: ProblemT, params: dict[str, Any]) -> Launch:
        """How the runtime launches this point's kernel: ``(grid, threads, shared_bytes)``, the
        grid as (x, y, z) CTAs, the threads of one CTA (the source's launch bound) and the
        dynamic shared memory in bytes (0 when the source declares all it uses statically)."""

    def render(self, problem: ProblemT, params: dict[str, Any]) -> str:
        """CUDA source for ``problem`` with ``params``: ``source_file`` rendered with
        `common_context` and the template's own `context` (which may not redefine a common name)."""
        common, own = self.common_context(problem, params), self.context(problem, params)
        clash = sorted(common.keys() & own.keys())
        if clash:
            raise ValueError(f"template {self.name!r}: context() redefines {', '.join(clash)}, "
                             "which every source of its kind receives already")
        return self.render_source(**common, **own)

    def common_context(self, problem: ProblemT, params: dict[str, Any]) -> dict[str, Any]:
        """The values every source receives: the kernel's ``name`` and the point's parameters
        under their own names."""
        return {"name": self.kernel_name(problem, params), **params}

    def context(self, problem: ProblemT, params: dict[str, Any]) -> dict[str, Any]:
        """The template's own values for its source, beside `common_context`'s: none by default."""
        return {}

    def validate(self) -> None:  # noqa: B027 (optional hook: templates without an example check nothing)
        """Check the template against its own example; raise TemplateRegistrationError if it
        does not match, has no parameters or does not render. Nothing to check by default."""


class TemplateRegistrationError(ValueError):
    """A template was refused at registration; the message names it and says why."""


_TEMPLATES: dict[str, KernelTemplate] = {}


def register_template(template: KernelTemplate, *, validate: bool = True) -> KernelTemplate:
    """Add ``template`` to the registry: from then on it takes part in code generation, the
    cost model and the search like a built-in. Checked here, not at compile time: the name is
    free, the source file exists and parses, and (``validate``) the spec matches a group of its
    own example, has parameters there and renders. Built-ins skip the example check at import
    (it traces a model) and are validated by the test suite instead."""
    if not isinstance(template, KernelTemplate):
        raise TemplateRegistrationError(f"register_template needs a KernelTemplate, got {type(template).__name__}")
    for attribute in ("name", "source_file"):
        if not isinstance(getattr(template, attribute, None), str):
            raise TemplateRegistrationError(f"template class {type(template).__name__} needs a str class attribute "
                                            f"{attribute!r}")
    if template.name in _TEMPLATES:
        raise TemplateRegistrationError(f"template name {template.name!r} is already taken "
                                        f"(by {type(_TEMPLATES[template.name]).__name__})")
    path = Path(template.template_dir) / template.source_file
    if not path.is_file():
        raise TemplateRegistrationError(f"template {template.name!r}: source file {path} not found")
    try:
        _environment(Path(template.template_dir)).parse(path.read_text())
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateRegistrationError(f"template {template.name!r}: {path}:{exc.lineno}: {exc.message}") from exc
    if validate:
        template.validate()
    _TEMPLATES[template.name] = template
    return template


def unregister_template(name: str) -> KernelTemplate:
    """Remove a registered template (a notebook re-registering an edited spec, a test cleaning up)."""
    if name not in _TEMPLATES:
        raise TemplateRegistrationError(f"no template named {name!r} is registered")
    return _TEMPLATES.pop(name)


def registered_templates() -> list[KernelTemplate]:
    """Every registered template, in registration order."""
    return list(_TEMPLATES.values())
