"""The built-in templates, registered here in one explicit order. For a pattern kind,
`group.group_templates` offers them in this order, after any user template. Modules that
choose templates import this one, so the built-ins are registered before they are asked for."""

from __future__ import annotations

from stof_cc.templates.attention import ATTENTION_TEMPLATES
from stof_cc.templates.elementwise import ELEMENTWISE
from stof_cc.templates.gemm_epilogue import GEMM_EPILOGUE
from stof_cc.templates.gemm_layernorm import GEMM_LAYERNORM
from stof_cc.templates.overflow_clamp import OVERFLOW_CLAMP
from stof_cc.templates.registry import KernelTemplate, register_template
from stof_cc.templates.row_reduce import ROW_REDUCE

BUILTIN_TEMPLATES: tuple[KernelTemplate, ...] = (
    *ATTENTION_TEMPLATES,
    ELEMENTWISE,
    GEMM_EPILOGUE,
    GEMM_LAYERNORM,
    ROW_REDUCE,
    OVERFLOW_CLAMP,
)

# Not validated at import: a group template's example traces a model; the test suite checks the built-ins.
for _template in BUILTIN_TEMPLATES:
    register_template(_template, validate=False)
