"""The `stof-cc` command line.

Commands that exist are the ones that work. `compile` generates and nvcc-compiles the group
kernels and writes the build folder; `tune` measures them on the GPU; running a compiled model
is the Python API's `stof_cc.compile`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import stof_cc
from stof_cc.backends.nvcc import NVCC_MISSING, CompileError, compile_cubin, nvcc_path, nvcc_version
from stof_cc.backends.pycuda_backend import BackendError
from stof_cc.codegen import NotFusable
from stof_cc.ir.frontend import TraceError
from stof_cc.ir.graph import Graph, GraphError
from stof_cc.ir.interpret import interpret
from stof_cc.ir.ops import OPAQUE, pattern_kind
from stof_cc.ir.paths import PathError, blocking_file, path_in
from stof_cc.ir.reference import masked_attention, relative_error
from stof_cc.loading import FactoryError, load_factory
from stof_cc.masks import MaskDescription, MaskError
from stof_cc.masks.cli import add_masks_command, folder_path
from stof_cc.masks.spec import parse_spec
from stof_cc.passes import PassReports, cast_floating, dump_to, lower
from stof_cc.runtime.attention import attention
from stof_cc.runtime.build import build_groups, format_builds
from stof_cc.runtime.report import write_report
from stof_cc.templates.attention import AttentionInputError, AttentionProblem, config_label
from stof_cc.templates.pricing import (
    TARGETS,
    choose_target,
    chosen_target,
    target_capability,
    target_name,
)
from stof_cc.tune.attention import (
    as_description,
    attention_kernel,
    explain_attention,
    launched_form,
)
from stof_cc.tune.database import (
    DamagedDatabaseError,
    NewerDatabaseError,
    TuningDatabase,
    TuningDatabaseError,
    check_database_argument,
    default_path,
)
from stof_cc.tune.model import tune_model
from stof_cc.tune.scheme import choose_scheme

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        choose_target(getattr(args, "arch", None))
        return args.run(args)
    except (FactoryError, TraceError, GraphError, AttentionInputError, MaskError, CompileError,
            BackendError, TuningDatabaseError, PathError) as exc:
        print(f"stof-cc: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`stof-cc inspect ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141
    except OSError as exc:  # a --build-dir, --out or --db that cannot be written (under a file, read-only)
        print(f"stof-cc: error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    finally:
        choose_target(None)


def build_parser() -> argparse.ArgumentParser:
    """Every command and option, each with its help; a command's handler is its ``run`` default."""
    parser = argparse.ArgumentParser(prog="stof-cc", description="Compiler for masked transformer inference.")
    parser.add_argument("--version", action=_PrintVersions, help="print the versions of stof-cc, torch and nvcc")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="trace a model and show its graph, op kinds and opaque ops")
    inspect.add_argument("model", help="FILE.py:FACTORY; the factory returns (module, args[, kwargs])")
    inspect.add_argument("--build-dir", default="stof_build", type=folder_path, help="where the .dot file goes (default: %(default)s)")
    inspect.add_argument("--quiet-graph", action="store_true", help="do not print the whole graph")
    inspect.add_argument("--check", action="store_true",
                         help="also run the graph with the interpreter and compare with the module")
    inspect.add_argument("--passes", action="store_true",
                         help="a line per pass saying what it did (--check checks the graph after each), then the fusion partition")
    inspect.add_argument("--dump-ir", metavar="DIR", help="write the graph after tracing and after each pass to DIR")
    inspect.add_argument("--mask", metavar="SPEC", help=MASK_HELP)
    inspect.add_argument("--arch", type=_arch, choices=sorted(TARGETS), help=ARCH_HELP)
    inspect.set_defaults(run=_cmd_inspect)

    attention = sub.add_parser("attention", help="show the attention kernel the cost model picks, and why")
    attention.add_argument("--mask", default="full", help="mask spec as in `masks show` (default: %(default)s)")
    attention.add_argument("--seq", type=int, required=True, help="sequence length (queries and keys)")
    attention.add_argument("--batch", type=int, default=1, help="batch size (default: %(default)s)")
    attention.add_argument("--heads", type=int, default=12, help="attention heads (default: %(default)s)")
    attention.add_argument("--head-dim", type=int, default=64,
                           help="size of one head: 32, 64 or 128 (default: %(default)s)")
    attention.add_argument("--dtype", choices=sorted(_DTYPES), default="float16",
                           help="dtype of q, k and v (default: %(default)s)")
    attention.add_argument("--build-dir", type=folder_path, help="write the chosen kernel's .cu here and compile it with nvcc")
    attention.add_argument("--arch", type=_arch, choices=sorted(TARGETS), help=ARCH_HELP + " (not with --check)")
    attention.add_argument("--check", action="store_true",
                           help="run the chosen kernel on random inputs against the torch reference (needs a GPU)")
    attention.set_defaults(run=_cmd_attention)

    compile_ = sub.add_parser("compile", help="partition a model into fusion groups and write (and nvcc-compile) "
                                              "each group's kernel")
    compile_.add_argument("model", help="FILE.py:FACTORY; the factory returns (module, args[, kwargs])")
    compile_.add_argument("--build-dir", default="stof_build", type=folder_path, help="where <model>/<group>.cu go (default: %(default)s)")
    compile_.add_argument("--no-nvcc", action="store_true", help="write the sources only")
    compile_.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                          help="the model and its floating inputs are cast to this before tracing (%(default)s)")
    compile_.add_argument("--mask", metavar="SPEC", help=MASK_HELP)
    compile_.add_argument("--arch", type=_arch, choices=sorted(TARGETS), help=ARCH_HELP)
    compile_.add_argument("--why", action="store_true",
                          help="under each group torch runs, every template's reason, not only the one that matters")
    compile_.set_defaults(run=_cmd_compile)

    tune = sub.add_parser("tune", help="measure the best kernel parameters of every generated group on the GPU "
                                       "and remember them in the tuning database")
    tune.add_argument("model", help="FILE.py:FACTORY; the factory returns (module, args[, kwargs])")
    tune.add_argument("--db", help="database file (default: $STOF_CC_TUNING_DB or the user cache directory)")
    tune.add_argument("--top-k", type=_positive, default=8,
                      help="candidates per group measured in stage 2, at least 1 (%(default)s)")
    tune.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                      help="the model's dtype, as stof_cc.compile's dtype= (default: %(default)s)")
    tune.set_defaults(run=_cmd_tune)

    cache = sub.add_parser("cache", help="list or clear the tuning database")
    cache.add_argument("action", choices=("list", "clear"), help="list the records, or remove them all")
    cache.add_argument("--db", help="database file (default: $STOF_CC_TUNING_DB or the user cache directory)")
    cache.set_defaults(run=_cmd_cache)

    add_masks_command(sub)
    return parser


class _PrintVersions(argparse.Action):
    """``--version``: asks nvcc only when given, then exits, as argparse's own version action does."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(versions())
        parser.exit()


def versions() -> str:
    """stof-cc's version, torch's (and the CUDA it was built for), nvcc's where one is found."""
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
    try:
        nvcc = f"nvcc {nvcc_version()} ({nvcc_path()})" if nvcc_path() else "nvcc not found"
    except CompileError as exc:  # a CUDA_HOME without a working nvcc: the message names it
        nvcc = str(exc)
    except (OSError, subprocess.CalledProcessError) as exc:
        nvcc = f"nvcc at {nvcc_path()} does not run: {exc}"
    return f"stof-cc {stof_cc.__version__}\ntorch {torch.__version__} ({cuda})\n{nvcc}"


def describe_os_error(exc: OSError) -> str:
    """What went wrong writing a path, naming the file in the way when a folder was expected.
    Never raises: the path may be one no stat can reach (no access, a name too long)."""
    if not isinstance(exc.filename, (str, bytes, os.PathLike)):
        return str(exc)
    path = Path(os.fsdecode(exc.filename))
    in_the_way = blocking_file(path)
    if in_the_way is not None and isinstance(exc, (FileExistsError, NotADirectoryError)):
        return f"cannot write {path}: {in_the_way} is a file, not a folder"
    return f"cannot write {path}: {exc.strerror or exc}"


def _cmd_inspect(args: argparse.Namespace) -> int:
    mask = _mask_argument(args)  # a bad spec fails before the model loads
    module, example_args, example_kwargs = load_factory(args.model)
    stages: dict[str, Graph] = {}
    instruments = [lambda stage, graph: stages.setdefault(stage, graph)]
    if args.dump_ir:
        instruments.append(dump_to(args.dump_ir))
    reports = PassReports()
    graph, plan = lower(module, example_args, example_kwargs, name=_model_name(args.model), reports=reports,
                        instrument=lambda stage, g: [instrument(stage, g) for instrument in instruments])
    lowered = graph  # the attention nodes the passes recognised: what --mask applies to
    if args.passes:
        print(f"{reports}\n\nfusion partition (`stof-cc compile` generates it, splitting a group no template takes whole):\n{plan}\n")
    else:
        graph = stages["trace"]
    if not args.quiet_graph:
        print(graph)
        print()
    print(format_histogram(graph))
    opaque = [n for n in graph.nodes() if n.op == OPAQUE]
    checks = sum(n.op == "assert_metadata" for n in graph.nodes())  # kind "opaque" in the table, yet no work
    print(f"\nopaque ops (run through torch): {len(opaque)}"
          + (f"; trace-time checks (assert_metadata, dropped by canonicalize): {checks}" if checks else ""))
    for node in opaque:
        print(f"  %{node.name}: {node.target}")
    _print_attention_choices(lowered, mask)
    dot_path = path_in(Path(args.build_dir), graph.name, "graph.dot")
    dot_path.parent.mkdir(parents=True, exist_ok=True)
    dot_path.write_text(graph.to_dot())
    print(f"\nwrote {dot_path}")
    if args.dump_ir:
        print(f"wrote the graph after each stage to {args.dump_ir}/")
    if args.check:
        if mask is not None:  # no eager module computes the replaced mask: say what the check covers
            print("--check: the graph as traced, with the model's own masks (--mask is not applied to it: the "
                  "attention kernels' GPU tests check masks against torch)")
        return _check_against_module(graph, module, example_args, example_kwargs)
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    mask = _mask_argument(args)  # a bad spec fails before the model loads
    module, example_args, example_kwargs = load_factory(args.model)  # a bad FILE.py:FACTORY fails first
    _say_assumed_gpu("generating")
    graph, plan = lower(module, example_args, example_kwargs, dtype=getattr(torch, args.dtype),
                        name=_model_name(args.model))
    plan = choose_scheme(graph, plan)
    _say_mask(graph, mask)
    compile_kernels = not args.no_nvcc and nvcc_path() is not None
    out_dir = path_in(Path(args.build_dir), graph.name)
    builds = build_groups(graph, plan, out_dir, compile_kernels=compile_kernels, mask=mask)
    print(format_builds(builds, plan, why=args.why))
    report = write_report(graph, plan, builds, out_dir)
    print(f"\nwrote {out_dir}/: the .cu files above, {', '.join(p.name for p in report)}")
    written = [b for b in builds if b.path]
    skipped = " (not compiled: --no-nvcc)" if args.no_nvcc else f" (not compiled: {NVCC_MISSING})"
    print(f"\n{len(written)} of {len(builds)} groups generated"
          + (f", all compiled with nvcc for {target_name().split()[0]}" if compile_kernels else skipped))
    for reason in plan.refused:
        print(f"not fused: {reason}")
    return 0


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _cmd_tune(args: argparse.Namespace) -> int:
    module, example_args, example_kwargs = load_factory(args.model)  # a typo is found before the GPU is asked for
    check_database_argument(*_database_choice(args))
    if not torch.cuda.is_available():
        print("stof-cc: error: tuning measures kernels on the GPU, and no CUDA device is visible", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)  # as `stof_cc.compile` and `stof-cc compile` cast: the same signatures
    graph, plan = lower(module, example_args, example_kwargs, dtype=dtype, name=_model_name(args.model))
    example_args, example_kwargs = cast_floating((tuple(example_args), dict(example_kwargs or {})), dtype)
    db = TuningDatabase(args.db)
    started = time.perf_counter()
    _, reports = tune_model(graph, choose_scheme(graph, plan), example_args, example_kwargs, database=db,
                            top_k=args.top_k)
    measured = sum(r.measured for r in reports)
    print(f"\ntuned {len(reports)} group(s) in {time.perf_counter() - started:.1f} s; {measured} candidate(s) "
          f"measured; database {db.path}")
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    path, origin = _database_choice(args)
    check_database_argument(path, origin)  # touches nothing
    path = Path(path)
    if not path.exists():  # nothing tuned yet: the first tuned compile makes it
        print(f"{path} ({origin}): no tuning database there"
              + ("; nothing to clear" if args.action == "clear" else
                 " yet, 0 records (a tuned compile or `stof-cc tune` makes it)"))
        return 0
    damaged = None
    try:
        checked = TuningDatabase(path, read_only=True)  # not a tuning database: an error, and the file untouched
    except DamagedDatabaseError as exc:  # ours or not, a writer moves it aside: `clear` may
        damaged = exc
    except TuningDatabaseError as exc:
        raise TuningDatabaseError(f"{exc}; stof-cc leaves such a file as it is: move it aside or remove it, "
                                  f"or name another file ({origin})") from None
    else:
        checked.close()
        if args.action == "clear" and checked.written_by_newer:  # its records are the newer version's to clear
            raise NewerDatabaseError(f"{path} ({origin}) was written by a newer stof-cc, which this one reads but "
                                     "never writes into: clear it with that version, or name another file")
    if args.action == "clear":
        db = TuningDatabase(path)  # a damaged file is moved aside first, and the warning says where
        removed = db.clear()
        if removed is None:  # read-only or locked: it said "removed 0" and exited 0 (found by review)
            raise TuningDatabaseError(f"{db.path} ({origin}): nothing was cleared (the warning above says why)")
        print(f"{db.path}: removed {removed} record(s)")
        return 0
    if damaged is None:
        db = TuningDatabase(path, read_only=True)  # a listing creates, moves and writes nothing
        try:
            records = db.records(strict=True)
        except DamagedDatabaseError as exc:
            damaged = exc
    if damaged is not None:
        raise DamagedDatabaseError(f"{damaged}: its records cannot be listed; `stof-cc cache clear` or the next tuned "
                                   f"compile moves it aside (to {path.name}.corrupt-<time>-<pid>) and starts an empty "
                                   f"one ({origin})")
    print(f"{db.path}: {len(records)} record(s)")
    for r in records:
        measured = "   failed   " if r.failed else f"{r.micros:9.2f} us"  # stage 2 found no correct point
        print(f"  {r.template:<16} {r.signature:<40} {measured}  {json.dumps(r.params, sort_keys=True)}  "
              f"[{r.device}]")
    return 0


def _database_choice(args: argparse.Namespace) -> tuple[str | Path, str]:
    """The tuning database's path and where it came from, for messages: ``--db``, the
    STOF_CC_TUNING_DB variable, or the default."""
    if args.db is not None:
        return args.db, "--db"
    if os.environ.get("STOF_CC_TUNING_DB"):
        return default_path(), "STOF_CC_TUNING_DB"
    return default_path(), "the default"


def _cmd_attention(args: argparse.Namespace) -> int:
    if args.check and args.arch:
        print("stof-cc: error: --check runs the kernel on the visible GPU; it does not go with --arch", file=sys.stderr)
        return 2
    mask = parse_spec(args.mask, seq=args.seq)
    _say_assumed_gpu("choosing the kernel")
    choice = explain_attention(args.batch, args.heads, args.seq, args.seq, args.head_dim, mask, _DTYPES[args.dtype])
    print(f"attention B={args.batch} H={args.heads} S={args.seq} D={args.head_dim} {args.dtype}, mask {mask!r}")
    print(choice.explain())
    problem = AttentionProblem(args.batch, args.heads, args.seq, args.seq, args.head_dim, _DTYPES[args.dtype])
    if args.build_dir:  # the kernel that runs: a dilated window's is its residues' (`launched_form`)
        _write_and_compile(choice, launched_form(problem, as_description(mask))[0], Path(args.build_dir))
    if args.check:
        return _check_attention(problem, mask)
    return 0


def _write_and_compile(choice, problem: AttentionProblem, build_dir: Path) -> None:
    """The chosen kernel's source under build_dir/attention/, and ptxas's verdict on it."""
    name = choice.template.kernel_name(problem, choice.params)
    source_path = path_in(build_dir, "attention", f"{name}.cu")
    source_path.parent.mkdir(parents=True, exist_ok=True)
    source = choice.template.render(problem, choice.params)
    source_path.write_text(source)
    print(f"\nwrote {source_path}")
    if nvcc_path() is None:
        print(f"not compiled: {NVCC_MISSING}")
        return
    major, minor = target_capability()
    arch = f"sm_{major}{minor}" + choice.template.arch_features
    report = compile_cubin(source, arch=arch, source_path=source_path).resources[name]
    print(f"nvcc {arch}: {report.registers} registers, {report.spill_stores} bytes spilled, "
          f"{choice.template.shared_bytes(problem, choice.params)} bytes of dynamic shared memory")


def _check_attention(problem: AttentionProblem, mask) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: the kernel was not run against the reference", file=sys.stderr)
        return 2  # --check asked for a check: none ran
    q, k, v = (torch.randn(problem.batch, problem.heads, problem.seq_q, problem.head_dim,
                           device="cuda", dtype=problem.dtype) for _ in range(3))
    out = attention(q, k, v, mask)  # the pick explain_attention told (the pick that runs)
    dense = mask.to_dense(problem.seq_q, problem.seq_k, batch=problem.batch, heads=problem.heads).cuda()
    ref = masked_attention(q, k, v, dense)
    err = relative_error(out, ref)
    ok = err < 1e-2
    print(f"kernel vs torch reference: relative error {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def _attention_nodes(graph: Graph) -> list:
    return [n for n in graph.nodes() if pattern_kind(n.op) == "attention"]


def _say_mask(graph: Graph, mask: MaskDescription | None) -> None:
    """What ``--mask`` does here: the attention nodes it replaces the masks of, or that there are none."""
    if mask is None:
        return
    nodes = _attention_nodes(graph)
    if nodes:
        print(f"--mask: {mask!r} replaces the own mask of {len(nodes)} attention node(s): "
              + ", ".join(f"%{n.name}" for n in nodes))
    else:
        print(f"--mask: {mask!r} applies to nothing: the passes found no attention node in this model", file=sys.stderr)


def _print_attention_choices(graph: Graph, mask: MaskDescription | None) -> None:
    """For each SDPA or recognised attention node: the kernel the cost model would pick (under
    ``mask``, else its own: causal when it says so, none when it has none), or why there is none."""
    nodes = _attention_nodes(graph)
    if mask is not None:
        print()
        _say_mask(graph, mask)
    if nodes and (chosen_target() or not torch.cuda.is_available()):
        print()
        _say_assumed_gpu("choosing attention kernels")
    for node in nodes:
        try:
            template, problem, params, _, _ = attention_kernel(graph, node, mask)
        except NotFusable as why:
            print(f"\n{why}")
            continue
        print(f"\n%{node.name}: attention kernel {config_label(params)} ({template.kernel_name(problem, params)})")


MASK_HELP = ("a mask spec as in `masks show` (causal, sliding:w=256, bigbird:..., & | ~ to combine) replacing the "
             "attention nodes' own masks, as stof_cc.compile(mask=) does")


def _mask_argument(args: argparse.Namespace) -> MaskDescription | None:
    """``--mask`` as a description (grid masks need a sequence length: `stof-cc attention` takes those)."""
    if args.mask is None:
        return None
    if "grid:" in args.mask and args.command != "attention":
        raise MaskError(f"--mask {args.mask!r}: a grid: mask depends on the sequence length, which {args.command} "
                        "does not take; write the mask out (causal, sliding:w=256, bigbird:..., `stof-cc masks list`)")
    return parse_spec(args.mask)


ARCH_HELP = ("generate for this GPU generation instead of the visible GPU (or, without one, the H100); "
             "sm_80, sm_86 and sm_89 get no wgmma kernels; sm_90a is sm_90 (its wgmma kernels are built for sm_90a)")


def _arch(text: str) -> str:
    """--arch's value: sm_90a, the name nvcc and these docs give Hopper's wgmma target, is sm_90."""
    return "sm_90" if text == "sm_90a" else text


def _say_assumed_gpu(doing: str) -> None:
    """Say which GPU a command targets when it is not the visible one: ``--arch``'s, or without a
    GPU the H100, whose constants the cost model and templates hold (`templates/pricing.py`)."""
    if chosen_target() or not torch.cuda.is_available():
        print(f"{'--arch' if chosen_target() else 'no GPU visible'}: {doing} for {target_name()}")


def format_histogram(graph: Graph) -> str:
    """Op histogram sorted by pattern kind then count: what fusion will see."""
    rows = sorted(graph.op_histogram().items(), key=lambda item: (pattern_kind(item[0]), -item[1], item[0]))
    width = max(len(op) for op, _ in rows)
    lines = [f"{'op':<{width}}  {'kind':<11}  count", f"{'-' * width}  {'-' * 11}  -----"]
    lines += [f"{op:<{width}}  {pattern_kind(op):<11}  {count:5d}" for op, count in rows]
    return "\n".join(lines)


def _check_against_module(graph: Graph, module: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """Interpret the graph and compare every output tensor with the eager module's."""
    with torch.no_grad():
        try:
            expected = module.eval()(*args, **kwargs)
        except Exception as exc:  # the model's own failure, not stof-cc's: one line, not torch's traceback
            first = next(iter(str(exc).strip().splitlines()), "")
            raise FactoryError(f"the model fails on its own example inputs, run eagerly in torch: "
                               f"{type(exc).__name__}: {first}") from exc
        got = interpret(graph, *args, **kwargs)
    exp_leaves = [t for t in torch.utils._pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    got_leaves = [t for t in torch.utils._pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    if len(exp_leaves) != len(got_leaves):
        print(f"interpreter vs eager module: {len(got_leaves)} outputs where the module gives {len(exp_leaves)} "
              "-> MISMATCH")
        return 1
    worst = max((_leaf_error(g, e) for g, e in zip(got_leaves, exp_leaves, strict=True)), default=0.0)
    ok = worst <= 1e-5
    print(f"interpreter vs eager module: {len(got_leaves)} outputs, max abs error {worst:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def _leaf_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference of two outputs; NaN and infinities agree where both have them
    (a fully masked softmax), a shape or dtype kind that differs is infinitely wrong, booleans
    compare as 0/1 and an empty output has no error."""
    if got.shape != want.shape or got.dtype.is_floating_point != want.dtype.is_floating_point:
        return math.inf
    if got.numel() == 0:
        return 0.0
    got, want = got.double(), want.double()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    return float(torch.where(same, 0.0, (got - want).abs().nan_to_num(math.inf)).max())


def _model_name(reference: str) -> str:
    path, _, factory = reference.rpartition(":")
    stem = Path(path).stem
    return stem if factory == "factory" else f"{stem}_{factory}"


if __name__ == "__main__":
    sys.exit(main())
