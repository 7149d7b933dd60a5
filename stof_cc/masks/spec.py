"""Text specs for masks, as typed on the command line: `longformer:w=128,g=32`,
`causal`, `grid:bigbird`, combined with `|`, `&` and a `~` prefix (`causal&sliding:w=64`), grouped
by parentheses.

One table (PATTERNS) drives both the parser and `stof-cc masks list`.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

import stof_cc.masks.zoo as zoo
from stof_cc.masks.description import MaskDescription
from stof_cc.masks.errors import MaskError
from stof_cc.masks.workloads import GRID_MASKS, grid_mask

_REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """One `key=value` of a spec: the key typed, the factory argument it feeds, its kind
    ('int', 'ints' for a+b+c lists, 'bool'), and its default (absent: required)."""

    key: str
    arg: str
    kind: str = "int"
    default: object = _REQUIRED

    def syntax(self) -> str:
        value = {"int": "INT", "ints": "INT+INT+...", "bool": "0|1"}[self.kind]
        return f"{self.key}={value}" if self.default is _REQUIRED else f"[{self.key}={value}]"


@dataclass(frozen=True)
class Pattern:
    name: str
    factory: Callable[..., MaskDescription]
    params: tuple[Param, ...]
    summary: str

    def syntax(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(p.syntax() for p in self.params)


PATTERNS = {
    p.name: p
    for p in (
        Pattern("full", zoo.full, (), "no masking"),
        Pattern("causal", zoo.causal, (), "q >= k"),
        Pattern(
            "sliding",
            zoo.sliding_window,
            (Param("w", "w"), Param("causal", "causal", "bool", False)),
            "|q - k| <= w (causal=1: 0 <= q - k <= w)",
        ),
        Pattern(
            "dilated",
            zoo.dilated,
            (Param("w", "w"), Param("d", "dilation")),
            "|q - k| <= w*d and (q - k) % d == 0",
        ),
        Pattern("strided", zoo.strided, (Param("stride", "stride"),), "Sparse Transformer strided"),
        Pattern(
            "fixed",
            zoo.fixed,
            (Param("stride", "stride"), Param("c", "c")),
            "Sparse Transformer fixed: same stride chunk, or the last c columns of a chunk",
        ),
        Pattern(
            "longformer",
            zoo.longformer,
            (Param("w", "w"), Param("g", "global_tokens")),
            "|q - k| <= w, or q < g, or k < g",
        ),
        Pattern(
            "bigbird",
            zoo.bigbird,
            (
                Param("w", "w"),
                Param("g", "n_global"),
                Param("r", "random_blocks"),
                Param("block", "block", default=64),
                Param("seed", "seed", default=0),
            ),
            "longformer(w, g), or random block x block cells, about r per block row",
        ),
        Pattern(
            "document",
            zoo.document,
            (Param("lengths", "lengths", "ints"),),
            "packed documents of these lengths: doc(q) == doc(k)",
        ),
        Pattern(
            "key_padding",
            zoo.key_padding,
            (Param("lengths", "lengths", "ints"),),
            "batch element b attends to keys k < lengths[b]",
        ),
    )
}

GRID_SYNTAX = "grid:" + "|".join(GRID_MASKS)


def parse_spec(text: str, seq: int | None = None) -> MaskDescription:
    """The description a spec names: terms combined by ``~`` (complement), ``&`` and ``|``, in that
    order of precedence, and grouped by parentheses (``(causal|sliding:w=64)&~dilated:w=8,d=4``).
    `seq` is needed only by `grid:<name>` specs, whose window and document length depend on the
    sequence length."""
    if not isinstance(text, str) or not text.strip():
        raise MaskError(f"parse_spec: spec must be a non-empty string, got {text!r}")
    tokens = [token.strip() for token in re.split(r"([()|&~])", text)]
    parser = _Parser([token for token in tokens if token], text, seq)
    desc = parser.union()
    if parser.at < len(parser.tokens):  # what the grammar cannot follow: a ')' with no '(', or a term after a term
        left = parser.tokens[parser.at]
        what = "a ')' without its '('" if left == ")" else \
            f"{left!r} follows a term with no '|' or '&' between them"
        raise MaskError(f"spec {text!r}: {what}")
    return desc


@dataclass
class _Parser:
    """Recursive descent over a spec's tokens: operators, parentheses and the terms between them."""

    tokens: list[str]
    spec: str
    seq: int | None
    at: int = 0

    def union(self) -> MaskDescription:
        parts = [self.intersection()]
        while self._take("|"):
            parts.append(self.intersection())
        return functools.reduce(operator.or_, parts)

    def intersection(self) -> MaskDescription:
        parts = [self.factor()]
        while self._take("&"):
            parts.append(self.factor())
        return functools.reduce(operator.and_, parts)

    def factor(self) -> MaskDescription:
        if self._take("~"):
            return ~self.factor()
        if self._take("("):
            inner = self.union()
            if not self._take(")"):
                raise MaskError(f"spec {self.spec!r}: a '(' without its ')'")
            return inner
        token = self.tokens[self.at] if self.at < len(self.tokens) else None
        if token is None or token in ("|", "&", ")"):
            raise MaskError(f"spec {self.spec!r}: an empty term (an operator with nothing on one side, such as '&&')")
        self.at += 1
        return _term(token, self.spec, self.seq)

    def _take(self, operator_token: str) -> bool:
        if self.at < len(self.tokens) and self.tokens[self.at] == operator_token:
            self.at += 1
            return True
        return False


def _term(text: str, spec: str, seq: int | None) -> MaskDescription:
    name, _, args = text.partition(":")
    name = name.strip()
    if not name:
        raise MaskError(f"spec {spec!r}: an empty term (an operator with nothing on one side, such as '&&')")
    if name == "grid":
        if seq is None:
            raise MaskError(f"spec {spec!r}: grid masks depend on the sequence length; pass seq")
        if args.strip() not in GRID_MASKS:
            raise MaskError(
                f"spec {spec!r}: unknown grid mask {args.strip()!r}; valid: {', '.join(GRID_MASKS)}"
            )
        return grid_mask(args.strip(), seq)
    if name not in PATTERNS:
        valid = ", ".join([*PATTERNS, "grid"])
        raise MaskError(f"spec {spec!r}: unknown mask {name!r}; valid: {valid}")
    pattern = PATTERNS[name]
    return pattern.factory(**_arguments(pattern, args, spec))


def _arguments(pattern: Pattern, text: str, spec: str) -> dict[str, object]:
    by_key = {p.key: p for p in pattern.params}
    given: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if key not in by_key:
            valid = ", ".join(by_key) or "none"
            ints = [p.key for p in pattern.params if p.kind == "ints"]
            hint = (f" (a list is joined by '+': {ints[0]}=700+2048)" if ints and not eq and key.lstrip("-").isdigit()
                    else "")
            raise MaskError(
                f"spec {spec!r}: {pattern.name} has no key {key!r}; valid keys: {valid}{hint}"
            )
        if not eq or not value:
            raise MaskError(f"spec {spec!r}: {key} needs a value ({by_key[key].syntax()})")
        if key in given:
            raise MaskError(f"spec {spec!r}: {key} is given twice")
        given[key] = value
    arguments: dict[str, object] = {}
    for param in pattern.params:
        if param.key in given:
            arguments[param.arg] = _convert(param, given[param.key], spec)
        elif param.default is _REQUIRED:
            raise MaskError(
                f"spec {spec!r}: {pattern.name} needs {param.key} (syntax: {pattern.syntax()})"
            )
    return arguments


def _convert(param: Param, value: str, spec: str) -> object:
    try:
        if param.kind == "ints":
            return [int(v) for v in value.split("+")]
        if param.kind == "bool":
            return {"1": True, "true": True, "0": False, "false": False}[value.lower()]
        return int(value)
    except (ValueError, KeyError):
        expected = {"int": "an int", "ints": "ints joined by +", "bool": "0 or 1 (or true / false)"}[param.kind]
        hint = " (keys are separated by ',', e.g. longformer:w=128,g=32)" if any(c in value for c in ";: ") else ""
        raise MaskError(f"spec {spec!r}: {param.key}={value} is not {expected}{hint}") from None
