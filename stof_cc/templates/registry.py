"""The template registry and the shared Jinja2 environment.

A template is a CUDA source rendered by Jinja2 plus a Python spec that knows its
parameter space, its launch geometry and its shared-memory need. Rendering is pure:
(problem, params) -> source text, so sources and cache keys are deterministic.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import jinja2

TEMPLATE_DIR = Path(__file__).resolve().parent


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,  # a missing parameter is an error, not an empty string
        keep_trailing_newline=True,
    )


def render_file(filename: str, **context: Any) -> str:
    return _environment().get_template(filename).render(**context)


class KernelTemplate(ABC):
    """One template: its name, source file, parameter space and launch rule."""

    name: str
    source_file: str
    template_dir: Path = TEMPLATE_DIR  # where source_file and the files it imports live
    arch_features: str = ""  # "a" for sources that need the arch-specific target (sm_90a)
    min_capability: tuple[int, int] = (0, 0)  # oldest compute capability it compiles for
    capabilities: tuple[tuple[int, int], ...] | None = None  # exactly these, when arch-specific

    def runs_on(self, capability: tuple[int, int]) -> bool:
        capability = tuple(capability)
        return capability >= self.min_capability and (self.capabilities is None or capability in self.capabilities)

    @abstractmethod
    def space(self, problem: Any) -> list[dict[str, Any]]:
        """Every legal parameter point for ``problem`` (constraints already applied)."""

    @abstractmethod
    def render(self, problem: Any, params: dict[str, Any]) -> str:
        """CUDA source for ``problem`` with ``params``."""

    @abstractmethod
    def kernel_name(self, problem: Any, params: dict[str, Any]) -> str:
        """The extern "C" symbol the rendered source defines."""


_TEMPLATES: dict[str, KernelTemplate] = {}


def register_template(template: KernelTemplate) -> KernelTemplate:
    if template.name in _TEMPLATES:
        raise ValueError(f"template {template.name!r} is already registered")
    if not (TEMPLATE_DIR / template.source_file).is_file():
        raise ValueError(f"template {template.name!r}: source file {template.source_file} not found")
    _TEMPLATES[template.name] = template
    return template


def registered_templates() -> list[KernelTemplate]:
    """Every registered template, in registration order."""
    return list(_TEMPLATES.values())
