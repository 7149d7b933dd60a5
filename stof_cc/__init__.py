"""stof-cc: a compiler for masked (sparse) transformer inference on NVIDIA GPUs.

The public entry points live here; each stage of the pipeline (ir, masks, passes,
templates, tune, backends, runtime) is a subpackage with one job. See docs/architecture.md.
"""

import stof_cc.hf
from stof_cc.ir.frontend import TraceError, trace
from stof_cc.ir.graph import Graph, GraphError, Node, TensorSpec
from stof_cc.ir.interpret import interpret
from stof_cc.runtime.attention import attention
from stof_cc.runtime.attention_op import attention_op  # torch.ops.stof_cc.attention
from stof_cc.runtime.compiled import CompiledModule, compile  # noqa: A004 (stof_cc.compile, like torch.compile)
from stof_cc.runtime.dynamo_backend import backend, register_name
from stof_cc.templates.attention import AttentionInputError
from stof_cc.templates.group import GroupProblem, GroupTemplate, KernelOperand  # noqa: E402
from stof_cc.templates.registry import (  # noqa: E402
    TemplateRegistrationError,
    register_template,
    unregister_template,
)
from stof_cc.tune.attention import explain_attention

__version__ = "0.1.0"

register_name()  # torch.compile(model, backend="stof_cc") from a checkout too, not only where pip-installed
stof_cc.hf.register_when_imported()  # attn_implementation="stof_cc", whether transformers is imported before or after

__all__ = [
    "AttentionInputError",
    "CompiledModule",
    "GroupProblem",
    "GroupTemplate",
    "KernelOperand",
    "TemplateRegistrationError",
    "Graph",
    "GraphError",
    "Node",
    "TensorSpec",
    "TraceError",
    "attention",
    "attention_op",
    "backend",
    "compile",
    "explain_attention",
    "interpret",
    "register_template",
    "trace",
    "unregister_template",
    "__version__",
]
