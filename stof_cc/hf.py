"""HuggingFace's ``attn_implementation="stof_cc"`` (issue 36, first part), through transformers'
own registries: `AttentionMaskInterface` gets a mask function that returns a stof-cc mask
description (`HFMask`), never a dense S x S tensor, and `AttentionInterface` an attention function
that runs `stof_cc.attention` on it.

    import stof_cc   # registers it with transformers, imported before or after (stof_cc.hf.register())
    model = AutoModel.from_config(config, attn_implementation="stof_cc")

What the mask function recognises in transformers' mask functions (by identity, or by the
closures `and_masks`, `sliding_window_overlay` and `packed_sequence_mask_function` keep): causal,
bidirectional (no mask), a causal sliding window, packed sequences (found by transformers from
`position_ids` that restart at 0; see below); anything else (chunked attention, an
image's bidirectional block) becomes `masks.from_mask_mod` of the function itself, exact, its
block mask built on each call. The model's 2-D ``attention_mask`` becomes key padding, read on the device.
Packed sequences given as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (transformers' padding-free arguments,
which reach the attention function in encoders too, where its masks do not see packing) reach the
kernels as ``cu_seqlens`` (their row-window variant: the layer keeps its own mask's plan, the documents
are read on the device; `packed_documents`); packing that transformers finds from ``position_ids``
(its mask function's segment ids) reaches them as ``position_ids`` (`without_packing`). With a
position bias they are a `masks.document` mask instead (built on the host), and SDPA gets them in its
dense mask.

A position bias (T5's relative positions) is added to the scores; cross-attention (no mask, other
lengths) runs in the kernels too. Runs in transformers' own SDPA instead, with one warning naming
why (`_fallback`): autograd on (the kernels are inference-only), a CPU tensor (the kernels are
CUDA), an fp32 model (the kernels are fp16/bf16), the decode steps of ``generate()`` (offsets into
a cache, or fewer queries than keys under a mask) that the decode kernel does not take (anything but
a band of positions and key padding, a head dim other than 64 or 128; `DECODE_KERNEL` off sends
every one to SDPA), and a 4-D mask tensor the
caller built (transformers hands it over as it is). Refused with a clear error: dropout while training
(inference only) and softcapping (Gemma 2): use ``attn_implementation="eager"`` there. Attention sinks
(GPT-OSS's ``s_aux``: one logit per query head) run in every path: the prefill and decode kernels count them
in each row's softmax, the custom op takes them, and the SDPA fallback adds them as a zero key scored by the
sink (`_sdpa_with_sinks`); a decode step over its whole cache goes to the decode kernel, not SDPA's flash
kernel, when the model has sinks. A model whose attention is its own code (BLOOM, MPT:
`own_attention_code`) gets eager's mask tensor and runs as eager would, with one warning. Other code
that needs the mask as a tensor gets `MaskIsADescription` saying so where it first touches the
description (``generate()`` with a static cache only hands it on, and works); a model that picks its attention class by name (Falcon)
fails in transformers with ``KeyError: 'stof_cc'``. A query row whose keys are all padding gets 0 (SDPA attends
every key there); such rows are padding themselves.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import operator
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stof_cc.backends.attention_launch import sink_logits
from stof_cc.backends.decode_launch import decode_attention, decode_unsupported, every_key_counts
from stof_cc.masks import MaskDescription, document, from_mask_mod
from stof_cc.masks.kept import keep
from stof_cc.runtime.attention import attention
from stof_cc.templates.attention import SUPPORTED_HEAD_DIMS
from stof_cc.tune.attention import CAUSAL, causal_window, two_sided_window

NAME = "stof_cc"


@dataclass
class HFMask:
    """What the mask function hands the attention function in place of a mask tensor: the
    description, the key padding [B, KV] (True = attend; None when every key counts), and the
    arguments transformers gave (to build its dense mask where SDPA runs instead)."""

    description: MaskDescription | None
    key_padding: torch.Tensor | None
    arguments: dict[str, Any]
    # A mask made ahead of the forward (generate() with a static cache builds each step's masks first and
    # hands them to the model): transformers' mask creation reads ``ndim``, takes it for a prepared
    # 4-D mask, and the mask function returns it as it is (`mask_for_layer`).
    ndim = 4
    packing: PackedDocuments | None = field(default=None, repr=False)  # cu_seq_lens', beside description
    segments: torch.Tensor | None = field(default=None, repr=False)  # packing found from position ids: [B, S] ids
    _dense: torch.Tensor | None = field(default=None, repr=False)
    _positions: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _on_device: dict[tuple[str, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)
    _segment_documents: MaskDescription | None = field(default=None, repr=False)
    _built: bool = field(default=False, repr=False)  # dense() ran (its answer may be None)
    _offsets: tuple[int, int] | None = field(default=None, repr=False)

    def __getattr__(self, name: str):  # a tensor's attribute: code that expects a mask tensor
        if name.startswith("__"):  # protocols (copy, pickle) ask with getattr and expect AttributeError
            raise AttributeError(name)
        raise MaskIsADescription(f"reads .{name} of the attention mask")

    def __add__(self, other):
        raise MaskIsADescription("adds to the attention mask")

    __radd__ = __mul__ = __rmul__ = __getitem__ = __add__

    def offsets(self) -> tuple[int, int]:
        """(q_offset, kv_offset) as ints: the first query's and the first key's positions, read once
        per mask (a static cache's q_offset is a device tensor: one host sync, not one per layer)."""
        if self._offsets is None:
            self._offsets = tuple(0 if self.arguments.get(name) is None else int(self.arguments[name])
                                  for name in ("q_offset", "kv_offset"))
        return self._offsets

    def key_padding_on(self, device: torch.device) -> torch.Tensor | None:
        """The key padding on ``device``, copied once per forward and device: a model split over GPUs
        (``device_map``) runs layers on each, and accelerate's hooks cannot move a description."""
        return None if self.key_padding is None else self._copy_on("key_padding", self.key_padding, device)

    def _copy_on(self, name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tensor.device == device:
            return tensor
        if (name, device) not in self._on_device:
            self._on_device[name, device] = tensor.to(device)
        return self._on_device[name, device]

    def positions(self, device: torch.device) -> torch.Tensor:
        """The segment ids as position ids restarting at 0 at each document (the kernels'
        ``position_ids``) on ``device``, made once per forward and device: every layer shares this
        mask, and a model split over GPUs runs layers on each."""
        if device not in self._positions:
            segments = self.segments.to(device)
            rows = torch.arange(segments.shape[-1], device=device)
            opens = torch.ones_like(segments, dtype=torch.bool)
            opens[:, 1:] = segments[:, 1:] != segments[:, :-1]
            self._positions[device] = rows - torch.cummax(torch.where(opens, rows, 0), dim=-1).values
        return self._positions[device]

    def segment_documents(self) -> MaskDescription:
        """The segment ids as a document mask (where the kernels cannot take them as row windows),
        made once per forward."""
        if self._segment_documents is None:
            self._segment_documents = document(segment_ids=self.segments)
        return self._segment_documents

    def dense(self, device: torch.device | None = None) -> torch.Tensor | None:
        """transformers' own SDPA mask for these arguments (and packed sequences' documents), built once;
        None where transformers' SDPA would pass none either (`sdpa_mask`'s skips, with the flags
        transformers gave: a decode step or a causal prefill without padding, so SDPA runs its flash
        kernels, not the masked one). Packed sequences' documents always get a mask tensor."""
        if not self._built:
            self._build_dense(device)
        if self._dense is None or device is None:
            return self._dense
        return self._copy_on("dense", self._dense, device)  # the layer's device (a model split over GPUs)

    def _build_dense(self, device: torch.device | None) -> None:
        if self.arguments:
            from transformers.masking_utils import sdpa_mask

            skips = {} if self.packing is None else {"allow_is_causal_skip": False,
                                                       "allow_is_bidirectional_skip": False}
            self._dense = sdpa_mask(**(self.arguments | skips))
        if self.packing is not None:  # without transformers' arguments the description is the layer's mask
            documents, seq = self.packing.documents, self.packing.total
            whole = documents if self.arguments or self.description is None else self.description & documents
            own = whole.to_dense(seq, seq).to(device)
            self._dense = own if self._dense is None else self._dense & own.to(self._dense.device)
        self._built = True  # only once built: a build that raised is tried again, never taken for "no mask"


class MaskIsADescription(AttributeError, TypeError):
    """Code that expects a mask tensor met an `HFMask`: an AttributeError (so ``hasattr`` says
    False, as accelerate's device hooks ask) and a TypeError (what an operator raises)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"attn_implementation='{NAME}': code outside the attention {what}, which stof-cc hands "
                         "over as a description, not a tensor: the model's own attention code, say. stof-cc serves "
                         "models whose attention goes through transformers' AttentionInterface (Llama, Mistral, "
                         "Qwen, Gemma, BERT, T5, ...); use 'sdpa', or stof_cc.compile, here")


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the implementation once transformers has been imported (so ``import stof_cc``
    before ``import transformers`` works too, without stof-cc importing transformers itself).
    Its spec for transformers carries a loader that runs transformers' own, then registers; a
    lookup alone (``importlib.util.find_spec``, how libraries ask whether it is installed) leaves
    the hook in place."""

    def __init__(self) -> None:
        self._looking = False

    def find_spec(self, name, path, target=None):
        if name != "transformers" or self._looking:
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader, self)  # this spec's own loader: shared ones stay as they are
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    """transformers' loader, then `register` (and the hook removed: it has done its job)."""

    def __init__(self, loader, hook: _RegisterOnImport) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self._hook]
        try:
            register()
        except Exception as exc:  # noqa: BLE001 - transformers itself must still import
            warnings.warn(f"attn_implementation='{NAME}' could not be registered with this transformers "
                          f"({type(exc).__name__}: {exc})", stacklevel=2)

    def __getattr__(self, name: str):  # resource readers, get_data, is_package, ...: the real loader's
        return getattr(self._loader, name)


def register_when_imported() -> None:
    """`register` now if transformers is imported, else as soon as it is (what ``import stof_cc`` does)."""
    if "transformers" in sys.modules:
        register()
    elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


def register() -> None:
    """Make ``attn_implementation="stof_cc"`` available to every transformers model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_for_layer)
    for function in _CONSTANT_WHILE_TRACING:
        torch.compiler.assume_constant_result(function)


@functools.cache
def own_attention_code(config_class: type) -> bool:
    """A model whose modeling module computes attention in its own code, not through
    transformers' AttentionInterface (it has no ``ALL_ATTENTION_FUNCTIONS``: BLOOM and MPT in
    transformers 5.x; Falcon too, which fails earlier, picking its attention class by name). It
    reads the mask as a tensor, so it gets eager's."""
    modeling = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        return not hasattr(importlib.import_module(modeling), "ALL_ATTENTION_FUNCTIONS")
    except ImportError:  # a config defined elsewhere (remote code): assume the interface
        return False


_MADE_WITH = ("use_vmap", "allow_is_causal_skip", "local_size")  # what `_traced_mask` reads from extra, as made


def mask_for_layer(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                   device: torch.device | str = "cpu", **extra: Any) -> HFMask | torch.Tensor:
    """transformers' mask-interface call (the arguments its ``sdpa_mask`` takes) as an `HFMask`;
    for a model whose attention is its own code (`own_attention_code`), eager's mask tensor."""
    from transformers.masking_utils import causal_mask_function, eager_mask

    if isinstance(attention_mask, HFMask):  # made ahead of the forward by this function (`HFMask.ndim`)
        return attention_mask
    mask_function = mask_function or causal_mask_function
    if isinstance(q_offset, torch.Tensor):  # a static cache's own counter, which its update() advances in
        q_offset = q_offset.clone()  # place before the attention reads the mask: the mask keeps its value now
    arguments = {"batch_size": batch_size, "q_length": q_length, "kv_length": kv_length, "q_offset": q_offset,
                 "kv_offset": kv_offset, "mask_function": mask_function, "attention_mask": attention_mask,
                 "device": device, "use_vmap": extra.get("use_vmap", False),
                 # where SDPA runs instead, the mask it gets is transformers' own, with its skips
                 "allow_is_causal_skip": extra.get("allow_is_causal_skip", False),
                 "allow_is_bidirectional_skip": extra.get("allow_is_bidirectional_skip", False),
                 "local_size": extra.get("local_size")}
    config = extra.get("config")
    if torch.compiler.is_compiling():  # dynamo traces this call: no host reads, no closure introspection
        return _traced_mask(arguments, config, extra)
    if config is not None and own_attention_code(type(config)):
        _warn_once(f"{config.model_type} computes attention in its own code, not through transformers' "
                   "AttentionInterface: it runs as attn_implementation='eager' would (use stof_cc.compile for "
                   "stof-cc's kernels)")
        return eager_mask(**arguments, dtype=extra.get("dtype", torch.float32))
    key_padding = None
    if attention_mask is not None and attention_mask.dim() == 2:
        if attention_mask.shape[-1] < kv_offset + kv_length:  # a static cache's unwritten slots: not keys,
            attention_mask = torch.nn.functional.pad(  # as transformers' own padding of the mask says
                attention_mask, (0, kv_offset + kv_length - attention_mask.shape[-1]))
        window = attention_mask[:, kv_offset:kv_offset + kv_length]
        if not bool(window.all()):
            key_padding = window.to(device=device, dtype=torch.bool)
    description, segments = without_packing(mask_function)
    return HFMask(description, key_padding, arguments, segments=segments)


def describe(mask_function: Callable) -> MaskDescription | None:
    """A stof-cc description of a transformers mask function (None: every key attends)."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return CAUSAL  # one object per mask: choices and launch plans are cached per description
    if mask_function is mu.bidirectional_mask_function:
        return None
    segments = _segments(mask_function)
    if segments is not None:
        return document(segment_ids=segments)  # packed sequences: one document id per position
    captured = _captured(mask_function)
    if _made_by(mask_function, "and_masks") and "mask_functions" in captured:
        functions = list(captured["mask_functions"])
        if any(_segments(f) is not None for f in functions):
            functions = [_within_documents(f) for f in functions]
        return _described_together(functions)
    # |q - k| <= window, ModernBERT's local layers (a mask_mod rebuilt on the host every call before: found by review)
    window = captured.get("sliding_window") if _made_by(mask_function, "sliding_window_bidirectional_overlay") else None
    if isinstance(window, int) and not isinstance(window, bool) and window >= 1:
        return two_sided_window(window)
    return from_mask_mod(mask_function, name=getattr(mask_function, "__qualname__", "transformers mask"))


def without_packing(mask_function: Callable) -> tuple[MaskDescription | None, torch.Tensor | None]:
    """A mask function's description without the packed sequences transformers found (from
    position ids that restart at 0), and their segment ids [B, S] (one document id per position;
    None: no packing), which the kernels read on the device as row windows."""
    segments = _segments(mask_function)
    if segments is not None:
        return None, segments
    captured = _captured(mask_function)
    if _made_by(mask_function, "and_masks") and "mask_functions" in captured:
        functions = list(captured["mask_functions"])
        packed = [(f, found) for f in functions if (found := _segments(f)) is not None]
        if len(packed) == 1:
            rest = [_within_documents(f) for f in functions if f is not packed[0][0]]
            return _described_together(rest), packed[0][1]
    return describe(mask_function), None


def _described_together(functions: list[Callable]) -> MaskDescription | None:
    """The description of mask functions that all must allow a key (and_masks); causal with a
    window overlay is the sliding window."""
    from transformers import masking_utils as mu

    windows = [w for part in functions if (w := captured_window(part)) is not None]
    if len(functions) == 2 and mu.causal_mask_function in functions and len(windows) == 1 and windows[0] >= 2:
        return causal_window(windows[0] - 1)  # 0 <= q - k < window
    # a window under 2 (Qwen2-MoE's default config says 0, and builds that mask without using it: it
    # raised here) is described as written, by its function
    parts = [p for p in map(describe, functions) if p is not None]
    return functools.reduce(operator.and_, parts) if parts else None


def _segments(mask_function: Callable) -> torch.Tensor | None:
    """The segment ids of transformers' `packed_sequence_mask_function`, else None."""
    if not _made_by(mask_function, "packed_sequence_mask_function"):
        return None
    packed = _captured(mask_function).get("packed_sequence_mask")
    return packed if isinstance(packed, torch.Tensor) else None


def _within_documents(mask_function: Callable) -> Callable:
    """Beside packed sequences' document mask, transformers (5.2x) evaluates the other masks on
    positions counted from each document's start (`remap_positions_for_packed_sequence`); inside
    one document those are the indices minus a constant, so a mask of q - k alone (causal, a
    window) is the same function of the indices: the function it wraps, for those masks."""
    inner = _captured(mask_function).get("mask_function")
    if _made_by(mask_function, "remap_positions_for_packed_sequence") and callable(inner):
        described = describe(inner)
        if described is None or described is CAUSAL or repr(described).startswith("sliding_window("):
            return inner
    return mask_function


def captured_window(mask_function: Callable) -> int | None:
    """The window of transformers' `sliding_window_overlay` (k > q - window), else None."""
    if _made_by(mask_function, "sliding_window_overlay"):
        window = _captured(mask_function).get("sliding_window")
        return window if isinstance(window, int) else None
    return None


def _made_by(fn: Callable, factory: str) -> bool:
    return getattr(fn, "__qualname__", "").startswith(f"{factory}.<locals>.")


def _captured(fn: Callable) -> dict[str, Any]:
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except TypeError:  # not a Python function (a builtin, a callable object)
        return {}


# Decode steps (a few queries against a longer cache) through stof-cc's decode kernel
# (backends/decode_launch.py); False sends them to transformers' SDPA: docs/decisions.md#decode-kernel.
DECODE_KERNEL = True


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: HFMask | torch.Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface call: q [B, H, S, D], k and v [B, H_kv, S_k, D]; returns
    the output as [B, S, H, D] (what every transformers attention function returns) and no weights."""
    if dropout and module.training:
        raise ValueError(f"attn_implementation='{NAME}' is inference-only: {type(module).__name__} is training "
                         f"with attention dropout {dropout} (call model.eval())")
    if softcap is not None:
        raise ValueError(f"attn_implementation='{NAME}' does not softcap scores ({type(module).__name__} asks "
                         f"for softcap={softcap}): use attn_implementation='eager' for this model")
    sinks = _sinks(kwargs)
    selected = next((name for name, value in kwargs.items() if name.endswith("indices") and value is not None), None)
    if selected is not None:  # MiniMax-M3's block_indices: dropped, its sparse attention ran dense (found by review)
        raise ValueError(f"attn_implementation='{NAME}' does not read {selected} ({type(module).__name__} passes the "
                         "keys its sparse attention selects): use attn_implementation='sdpa' for this model")
    if isinstance(attention_mask, HFMask) and torch.compiler.is_compiling():
        # a mask made ahead of a forward that is compiled: generate() with a static cache on CUDA compiles it
        # and hands it the masks (one, or per layer type: Gemma3's); traced there, so the attention is a node
        # of the graph (the eager path broke the graph at its host reads and launched kernels between pieces)
        made = attention_mask.arguments
        attention_mask = _traced_mask(made, None, {key: made[key] for key in _MADE_WITH})
    if isinstance(attention_mask, TracedMask) or (torch.compiler.is_compiling() and attention_mask is None):
        return _traced_attention(module, query, key, value, attention_mask, scaling, sinks, **kwargs)
    position_bias = kwargs.pop("position_bias", None)  # T5's relative positions, added to the scores
    packing = packed_documents(query, key, kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None))
    if packing is not None and not isinstance(attention_mask, HFMask | None):
        raise ValueError(f"attn_implementation='{NAME}': {type(module).__name__} got cu_seq_lens_q (packed sequences) "
                         "and a mask tensor the caller built; pass one or the other")
    if packing is not None:
        attention_mask = _with_documents(attention_mask, packing, _causal(module, kwargs))
    if isinstance(attention_mask, torch.Tensor):  # a 4-D mask the caller built: transformers passes it as is
        return _fallback(module, query, key, value, attention_mask, scaling, position_bias, sinks,
                         "the caller passed a mask tensor (stof-cc describes the masks its mask function builds)",
                         **kwargs)
    if attention_mask is not None and not isinstance(attention_mask, HFMask):
        raise TypeError(f"attn_implementation='{NAME}' got a {type(attention_mask).__name__} mask, not the "
                        "description its own mask function makes: was the model's mask built by another "
                        "implementation?")
    step, refusal = _decode_step(query, key, value, attention_mask, position_bias) if DECODE_KERNEL \
        else (None, "the decode kernel is off (stof_cc.hf.DECODE_KERNEL)")
    if step is not None and query.shape[2] == 1 and step.key_padding is None and sinks is None \
            and every_key_counts(1, key.shape[2], step.mask, step.q_position, step.k_position):
        # one query over its whole cache, no padding: SDPA's flash kernel (no mask, GQA) is faster here,
        # by measurement (docs/decisions.md#decode-kernel); the mask is all true, so None is exact
        return _sdpa(module, query, key, value, None, scaling, position_bias, None, **kwargs)
    if step is not None:
        out = decode_attention(query, key, value, step.mask, scale=scaling, q_position=step.q_position,
                               k_position=step.k_position, key_padding=step.key_padding, sinks=sinks)
        return out.transpose(1, 2).contiguous(), None
    why = _why_sdpa(query, key, value, attention_mask, refusal)
    if why is not None:
        return _fallback(module, query, key, value, attention_mask, scaling, position_bias, sinks, why, **kwargs)
    description = None if attention_mask is None else attention_mask.description
    if attention_mask is None and _causal(module, kwargs) and query.shape[2] > 1:
        description = CAUSAL  # transformers' convention: no mask tensor on a causal module
    key_padding = None if attention_mask is None else attention_mask.key_padding_on(query.device)
    # Packed sequences reach the kernels as row windows read on the device (one kind at a call, and
    # not beside a bias); any other packing as a document mask, built on the host.
    cu_seqlens = position_ids = None
    documents = []
    packed = None if attention_mask is None else attention_mask.packing
    if packed is not None:
        if position_bias is None:
            cu_seqlens = packed.bounds_on(query.device)
        else:
            documents.append(packed.documents)
    if attention_mask is not None and attention_mask.segments is not None:
        if position_bias is None and cu_seqlens is None:
            position_ids = attention_mask.positions(query.device)
        else:
            documents.append(attention_mask.segment_documents())
    for part in documents:
        description = part if description is None else description & part
    out = attention(query, key, value, description, scale=scaling, key_padding=key_padding, bias=position_bias,
                    cu_seqlens=cu_seqlens, position_ids=position_ids, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The attention sinks the model passes (GPT-OSS's ``s_aux``: one logit per query head), taken out
    of ``kwargs`` (transformers' SDPA would ignore them: a wrong answer), or None."""
    given = {name: kwargs.pop(name) for name in ("s_aux", "sinks") if kwargs.get(name) is not None}
    if len(given) > 1:
        raise ValueError(f"attn_implementation='{NAME}' got attention sinks twice (s_aux and sinks): pass one")
    return next(iter(given.values()), None)


@dataclass
class PackedDocuments:
    """Packed sequences given as cu_seq_lens: the cumulative lengths, read once per forward, their
    document mask (for SDPA and the bias path) and their copies on each device the layers run on."""

    bounds: list[int]
    documents: MaskDescription
    _on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def bounds_on(self, device: torch.device) -> torch.Tensor:
        """The cumulative lengths as the kernels' ``cu_seqlens`` (int32 on ``device``), copied once
        per forward and device and shared by the layers."""
        if device not in self._on_device:
            self._on_device[device] = torch.tensor(self.bounds, dtype=torch.int32, device=device)
        return self._on_device[device]


@dataclass
class _Packing:
    """One forward's cu_seq_lens: the tensors (weakly), a stamp of their contents, what they say,
    and each layer mask they were added to (every layer of the forward gets the same `HFMask`, and
    with it the same description and launch plans). The masks refer to `found`, not back to this."""

    tensors: tuple[weakref.ref, weakref.ref]
    stamp: tuple
    found: PackedDocuments
    # id(layer mask), causal -> it, ours: the latest KEPT_COMBINED (a collator that hands the same
    # cu_seq_lens tensor to every forward keeps one _Packing, and each forward's new layer masks
    # were kept for ever: found by review)
    combined: OrderedDict[tuple, tuple[Any, HFMask]] = field(default_factory=OrderedDict)


_last_packing = threading.local()  # .packing: this thread's last forward's (threads serving in turn keep theirs)
KEPT_COMBINED = 8  # layer masks combined with one packing kept (a forward has one to three: full, sliding, chunked)


def _stamp(t: torch.Tensor) -> object:
    """What changes when ``t``'s contents do: its values (a few numbers, read once per layer; the
    version counter misses writes through numpy or ``.data``, which a collator refilling one buffer
    makes, and an inference tensor has none)."""
    return tuple(t.tolist())


def packed_documents(query: torch.Tensor, key: torch.Tensor, cu_q: torch.Tensor | None,
                     cu_k: torch.Tensor | None) -> _Packing | None:
    """The document mask of packed sequences given as transformers' padding-free arguments
    (``cu_seq_lens_q`` / ``cu_seq_lens_k``: cumulative lengths, from 0 to S, of the sequences packed
    in one row, as `DataCollatorWithFlattening` makes them and FlashAttention reads them), or None
    without them. Read once per forward: the layers after the first find it by the tensors and
    their stamp."""
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError(f"attn_implementation='{NAME}': cu_seq_lens_{'q' if cu_q is None else 'k'} is missing: packed "
                         "self-attention takes cu_seq_lens_q and cu_seq_lens_k, both given and equal")
    for name, given in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):  # a list or floats failed deep inside
        if not isinstance(given, torch.Tensor) or given.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"attn_implementation='{NAME}': {name} must be an int32 or int64 tensor of cumulative "
                             f"sequence lengths, got {getattr(given, 'dtype', type(given).__name__)}")
    if cu_q.dim() != 1 or cu_k.dim() != 1:
        raise ValueError(f"attn_implementation='{NAME}': cu_seq_lens_q and cu_seq_lens_k must be 1-D cumulative "
                         f"sequence lengths, got shapes {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    stamp = (_stamp(cu_q), _stamp(cu_k))
    last = getattr(_last_packing, "packing", None)
    if last is None or last.tensors[0]() is not cu_q or last.tensors[1]() is not cu_k or last.stamp != stamp:
        bounds = cu_q.cpu().tolist()
        if bounds != (bounds if cu_k is cu_q else cu_k.cpu().tolist()):
            raise ValueError(f"attn_implementation='{NAME}' packs self-attention only: cu_seq_lens_q and "
                             "cu_seq_lens_k must both be given and equal")
        lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        if not lengths or bounds[0] != 0 or min(lengths) < 0 or bounds[-1] == 0:
            raise ValueError(f"attn_implementation='{NAME}': cu_seq_lens_q must rise from 0 (cumulative sequence "
                             f"lengths), got {bounds}")
        bounds = [0] + [b for a, b in zip(bounds, bounds[1:], strict=False) if b > a]  # empty sequences hold nothing
        last = _Packing((weakref.ref(cu_q), weakref.ref(cu_k)), stamp,
                        PackedDocuments(bounds, document([b - a for a, b in zip(bounds, bounds[1:], strict=False)])))
        _last_packing.packing = last
    if query.shape[0] != 1:
        raise ValueError(f"attn_implementation='{NAME}': packed sequences (cu_seq_lens_q) fill a batch of one row, "
                         f"got a batch of {query.shape[0]}")
    if last.found.total != query.shape[2] or key.shape[2] != query.shape[2]:
        raise ValueError(f"attn_implementation='{NAME}': packed sequences of cu_seq_lens_q (ending at {last.found.total}) "
                         f"must fill one row: query {tuple(query.shape)}, key {tuple(key.shape)} ([B, H, S, D], B = 1)")
    return last


def _with_documents(mask: HFMask | None, packing: _Packing, causal_module: bool) -> HFMask:
    """The layer's mask with packed sequences beside it, made once per layer mask of the forward:
    the kernels read them as ``cu_seqlens``; SDPA, where it runs, gets the documents in its dense
    mask (transformers' own SDPA ignores cu_seq_lens)."""
    causal = mask is None and causal_module  # no mask on a causal module: causal
    key = (id(mask), causal)
    if key not in packing.combined:
        if mask is None:
            ours = HFMask(CAUSAL if causal else None, None, {}, packing=packing.found)
        else:  # packing transformers found from position ids stays too (the documents of both apply)
            ours = HFMask(mask.description, mask.key_padding, mask.arguments, packing=packing.found,
                          segments=mask.segments)
        keep(packing.combined, key, (mask, ours), KEPT_COMBINED)  # the layer mask held: its id not reused meanwhile
    return packing.combined[key][1]


def _causal(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether attention without a mask is causal, as transformers' SDPA decides it: the model's
    ``is_causal`` keyword, else the module's attribute, else True."""
    given = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if given is None else given)


@dataclass(frozen=True)
class DecodeStep:
    """A generation step as the decode kernel takes it: the band, the absolute positions of the first
    query and the first key, the key padding."""

    mask: MaskDescription | None
    q_position: int
    k_position: int
    key_padding: torch.Tensor | None


def _decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: HFMask | None,
                 position_bias: torch.Tensor | None) -> tuple[DecodeStep | None, str]:
    """(the step, "") where this call is one the decode kernel takes (queries at an offset into a
    longer cache, a band of positions, key padding at most), else (None, why the kernel does not take
    it): the kernels or SDPA run it, and SDPA's warning says why."""
    tokens, keys = query.shape[2], key.shape[2]
    if position_bias is not None:
        return None, "the decode kernel adds no position bias"
    if value.shape[-1] != query.shape[-1]:
        return None, "the decode kernel takes V with Q's head dim"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return None, "the decode kernel is inference-only"
    if mask is None:  # no mask: one query against every key (where SDPA's is_causal would line several
        if tokens != 1 or keys == 1:  # queries up with the first keys, not the last)
            return None, "the decode kernel takes several queries only under a mask"
        step = DecodeStep(None, keys - 1, 0, None)
    else:
        if mask.packing is not None or mask.segments is not None:
            return None, "the decode kernel takes no packed sequences"
        q_offset, kv_offset = mask.offsets()
        if tokens >= keys and not q_offset and not kv_offset:  # a prefill without a cache
            return None, "a prefill is not a decode step"
        step = DecodeStep(mask.description, q_offset, kv_offset, mask.key_padding_on(query.device))
        if step.key_padding is not None and step.key_padding.shape[-1] != keys:
            return None, f"key padding of {step.key_padding.shape[-1]} keys for {keys} keys"
    why = decode_unsupported(query, key, step.mask)
    return (step, "") if why is None else (None, f"the decode kernel does not take it: {why}")


def _why_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: HFMask | None,
              decode_refusal: str) -> str | None:
    """Why this call runs in transformers' SDPA rather than stof-cc's kernels, or None;
    ``decode_refusal`` is why the decode kernel did not take it."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return "autograd is on (the kernels are inference-only: call the model under torch.no_grad())"
    if query.shape[0] != key.shape[0]:  # learned queries of batch 1 over a batch of keys: SDPA broadcasts them
        return f"queries of batch {query.shape[0]} over keys of batch {key.shape[0]} (the kernels take one batch)"
    if not query.is_cuda:
        return "its tensors are on the CPU (the kernels run on CUDA devices)"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"the model runs in {query.dtype} (the kernels are fp16/bf16: load it with dtype=torch.bfloat16)"
    head_dims = _why_not_head_dims(query, value)
    if head_dims is not None:
        return head_dims
    if mask is not None and any(mask.offsets()):
        return f"a decode step (queries at an offset into a cache): {decode_refusal}"
    if query.shape[2] != key.shape[2] and mask is not None and mask.description is not None:
        return f"a decode step (fewer queries than keys under a mask): {decode_refusal}"
    return None  # cross-attention (no mask, other lengths) runs in the kernels


def _why_not_head_dims(query: torch.Tensor, value: torch.Tensor, every_head_dim: bool = False) -> str | None:
    """Why the op does not take these head dims (values of another head dim than the queries; unless
    ``every_head_dim``, as the CPU op's reference, Phi-3's 96, Gemma 3's 256, StableLM's 80), or None:
    such a prefill raised in the kernels' checks instead of running in SDPA (found by review)."""
    if value.shape[-1] != query.shape[-1]:
        return f"values of head dim {value.shape[-1]}, queries of {query.shape[-1]} (the kernels take one)"
    if not every_head_dim and query.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim {query.shape[-1]} (the kernels take {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    return None


_WARNED: set[str] = set()


def _warn_once(what: str) -> None:
    if torch.compiler.is_compiling():  # dynamo cannot trace warnings.warn: given once, at trace time
        _warned_while_tracing(what)
    else:
        _warn(what)


def _warn(what: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"attn_implementation='{NAME}': {what}", stacklevel=5)


def _fallback(module, query, key, value, mask: HFMask | torch.Tensor | None, scaling, position_bias,
              sinks: torch.Tensor | None, why: str, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA as ``attn_implementation="sdpa"`` runs it: its own mask, skips included,
    and the model's ``is_causal`` (a keyword the model passes, else the module's), which SDPA
    applies only where no mask is given (and the position bias, which it adds; the sinks as
    `_sdpa_with_sinks` adds them)."""
    _warn_once(f"transformers' sdpa runs this attention: {why}")
    return _sdpa(module, query, key, value, mask.dense(query.device) if isinstance(mask, HFMask) else mask,
                 scaling, position_bias, sinks, **kwargs)


def _sdpa(module, query, key, value, dense: torch.Tensor | None, scaling, position_bias,
          sinks: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward` with ``dense`` (transformers' mask, or None); with
    ``sinks``, `_sdpa_with_sinks`."""
    if sinks is not None:
        return _sdpa_with_sinks(module, query, key, value, dense, scaling, position_bias, sinks, kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if position_bias is not None:
        kwargs["position_bias"] = position_bias
    return sdpa_attention_forward(module, query, key, value, dense, scaling=scaling, **kwargs)[0], None


def _sdpa_with_sinks(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dense: torch.Tensor | None,
                     scaling: float | None, position_bias: torch.Tensor | None, sinks: torch.Tensor,
                     kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """SDPA has no sinks (transformers gives GPT-OSS no SDPA path): each head's sink joins as one more
    key, a zero vector whose score a float mask sets to the sink's logit, with a zero value, so its exp
    joins every row's denominator and adds nothing to the output, as GPT-OSS's eager code computes it.
    Exact, at the cost of a float mask of [B, H, S_q, S_k + 1] (SDPA's masked kernels): the fallback's
    price, not the kernels' path. ``dense`` (bool or additive) and the causal rule are SDPA's own:
    without a mask a causal module attends top-left, as SDPA's ``is_causal``."""
    batch, heads, rows, _ = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if dense is None and rows > 1 and _causal(module, kwargs):
        dense = torch.ones(rows, keys, dtype=torch.bool, device=query.device).tril()
    scores = query.new_zeros(batch, heads, rows, keys + 1)
    if dense is not None:
        scores[..., :keys] = torch.where(dense, 0.0, float("-inf")) if dense.dtype == torch.bool else dense
    if position_bias is not None:
        scores[..., :keys] += position_bias
    scores[..., keys] = sink_logits(sinks, query).reshape(1, heads, 1).to(scores.dtype)  # checks their count
    key, value = (torch.cat([t, t.new_zeros(batch, kv_heads, 1, t.shape[3])], dim=2) for t in (key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=scores, scale=scaling,
                                                           enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).contiguous(), None


# While dynamo traces (torch.compile, torch.export) it cannot read the closure cells of the mask
# functions transformers builds inside the forward (`fn.__closure__` raises there, and
# `inspect.getclosurevars` with it), nor host values (`bool(mask.all())`), nor `warnings.warn`: each
# was a graph break, ten in a two-layer Llama. So the traced path describes only what it can know
# exactly: transformers' causal and bidirectional functions by identity, and a causal window, whose
# closure holds constants only, by `assume_constant_result` (dynamo rebuilds the function and
# `describe` runs once, at trace time; its answer is baked into the graph). Those reach
# `torch.ops.stof_cc.attention` as a spec string, with the 2-D mask as key padding (read on the
# device); any other mask (packed sequences, chunked attention, image blocks, a custom mask function)
# runs transformers' own SDPA inside the graph with transformers' mask. No graph break either way.


class TracedMask:
    """The mask function's answer while dynamo traces: the op's spec (None: every key attends), the
    key padding [B, KV] (the 2-D mask as it is, no host read of whether any key is padded), whether
    stof-cc described the mask (else SDPA runs with transformers' mask) and transformers' arguments."""

    def __init__(self, spec: str | None, key_padding: torch.Tensor | None, described: bool,
                 arguments: dict[str, Any]) -> None:
        self.spec, self.key_padding, self.described, self.arguments = spec, key_padding, described, arguments


def _window_spec(mask_function: Callable) -> str:
    """The op's spec for transformers' causal window (and_masks of the causal function and a
    `sliding_window_overlay`), "" for anything else; run once at trace time. Only called on functions
    whose closures hold constants: on a closure over a tensor dynamo raises (not a graph break)."""
    captured = _captured(mask_function)
    parts = list(captured.get("mask_functions", ())) if _made_by(mask_function, "and_masks") else []
    windows = [w for part in parts if (w := captured_window(part)) is not None]
    if len(windows) == 1 and describe(mask_function) is causal_window(windows[0] - 1):
        return f"sliding:w={windows[0] - 1},causal=1"
    return ""


def _own_attention_code_traced(config_class: type) -> bool:
    return own_attention_code(config_class)


def _warned_while_tracing(what: str) -> bool:
    """`_warn` run by dynamo at trace time, not traced."""
    _warn(what)
    return True


# Run once at trace time, their answers baked into the graph: marked by `register` (marking imports dynamo,
# which `import stof_cc` must not).
_CONSTANT_WHILE_TRACING = (_window_spec, _own_attention_code_traced, _warned_while_tracing)


def _traced_mask(arguments: dict[str, Any], config: Any, extra: dict[str, Any]) -> TracedMask | torch.Tensor:
    """`mask_for_layer` while dynamo traces."""
    # names, not `from transformers import masking_utils`: dynamo refuses an import whose result is
    # transformers' lazy package (torch 2.11: "Bad import result")
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        eager_mask,
    )

    if config is not None and _own_attention_code_traced(type(config)):
        return eager_mask(**arguments, dtype=extra.get("dtype", torch.float32))
    fn, mask = arguments["mask_function"], arguments["attention_mask"]
    key_padding = None
    if mask is not None and mask.dim() == 2:
        offset = arguments["kv_offset"]
        key_padding = mask[:, offset:offset + arguments["kv_length"]].to(device=arguments["device"], dtype=torch.bool)
    if fn is causal_mask_function:
        return TracedMask("causal", key_padding, True, arguments)
    if fn is bidirectional_mask_function:
        return TracedMask(None, key_padding, True, arguments)
    chunked = extra.get("local_size") is not None \
        and extra.get("local_size") == getattr(config, "attention_chunk_size", None)  # its closure holds a tensor
    custom = extra.get("use_vmap", False)  # an or/and_mask_function was given: its closure may hold anything
    # transformers allows the causal skip only for its plain masks (no packing, no image blocks): causal or
    # a causal window, whose closures hold constants only
    if not custom and not chunked and extra.get("allow_is_causal_skip", False):
        spec = _window_spec(fn)
        if spec:
            return TracedMask(spec, key_padding, True, arguments)
    return TracedMask(None, key_padding, False, arguments)


def _traced_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: TracedMask | None, scaling: float | None, sinks: torch.Tensor | None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`attention_forward` while dynamo traces: `torch.ops.stof_cc.attention` where the op has a kernel
    for the call (on the CPU its torch reference; on CUDA fp16/bf16 without autograd), else
    transformers' SDPA with transformers' mask; either way a node of the graph. Packed sequences'
    ``cu_seq_lens_*`` go to the op, or into SDPA's mask (SDPA ignores them); their values cannot be
    checked while tracing (a host read), only that they pack one row of a self-attention."""
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    if (cu_q is None) != (cu_k is None) or (cu_q is not None and (query.shape[0] != 1 or key.shape[2] != query.shape[2])):
        raise ValueError(f"attn_implementation='{NAME}' packs one row of a self-attention: cu_seq_lens_q and "
                         f"cu_seq_lens_k must both be given, with a batch of one and as many keys as queries; got "
                         f"{'both' if cu_k is not None else 'one'}, queries {tuple(query.shape)}, keys {tuple(key.shape)}")
    why = _why_sdpa_traced(query, key, value, mask, kwargs)
    if why is None:
        if mask is None:
            spec = "causal" if _causal(module, kwargs) and query.shape[2] > 1 else None
            key_padding = None
        else:
            spec = mask.spec
            key_padding = None if mask.key_padding is None else mask.key_padding.to(query.device)  # device_map
        out = torch.ops.stof_cc.attention(query, key, value, spec, scaling, key_padding, cu_q, sinks)
        return out.transpose(1, 2).contiguous(), None
    from transformers.masking_utils import sdpa_mask

    _warn_once(f"transformers' sdpa runs this attention in the compiled graph: {why}")
    if cu_q is None:
        dense = None if mask is None else sdpa_mask(**mask.arguments)
    else:  # the documents into SDPA's mask, as `HFMask.dense` puts them
        rows = torch.arange(query.shape[2], device=query.device)
        document_of = torch.searchsorted(cu_q.to(query.device), rows, right=True)
        dense = (document_of[:, None] == document_of[None, :])[None, None]
        if mask is not None:
            dense = dense & sdpa_mask(**(mask.arguments | {"allow_is_causal_skip": False,
                                                           "allow_is_bidirectional_skip": False}))
        elif _causal(module, kwargs):
            dense = dense & (rows[:, None] >= rows[None, :])
    return _sdpa(module, query, key, value, dense, scaling, kwargs.pop("position_bias", None), sinks, **kwargs)


def _why_sdpa_traced(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: TracedMask | None,
                     kwargs: dict[str, Any]) -> str | None:
    """Why the op does not run this call while dynamo traces (None: it does), from what dynamo knows at
    trace time: dtypes, devices and shapes (guarded, not read on the host)."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return "autograd is on (torch.ops.stof_cc.attention has no backward)"
    if query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):
        return f"the model runs in {query.dtype} on CUDA (the kernels are fp16/bf16)"
    if not query.is_cuda and query.device.type != "cpu":
        return f"its tensors are on {query.device.type}"
    if kwargs.get("position_bias") is not None:
        return "a position bias (the op takes none)"
    head_dims = _why_not_head_dims(query, value, every_head_dim=not query.is_cuda)  # the CPU op runs any
    if head_dims is not None:
        return head_dims
    if mask is not None and not mask.described:
        return ("a mask stof-cc describes only outside a compiled graph (packed sequences, chunked, image blocks, "
                "custom; a decoder called with no cache and no attention_mask gets transformers' packed-sequence "
                "mask too: pass attention_mask=torch.ones_like(input_ids) to run stof-cc there)")
    offsets = () if mask is None else (mask.arguments["q_offset"], mask.arguments["kv_offset"])
    if any(not isinstance(offset, int) or offset != 0 for offset in offsets) \
            or (query.shape[2] != key.shape[2] and mask is not None and mask.spec is not None):
        return "a decode step (queries at an offset into a cache): compiled graphs do not call the decode kernel"
    return None
