"""Dimension labels of one op invocation (dimops-style), instantiated on traced shapes.

Every dim of every tensor an op touches carries factors (label, size). A label shared
between tensors means "splitting this label splits these dims together". A label is
*reduced* (`k+`) when splitting it leaves the output as partial sums, *fixed* (`d^`) when it
must not be split, and may need a special implementation (`impl`) to be split at all.
A dim made of several factors, like `(3 c)` for a fused q|k|v projection, splits on one
factor: the tensor is then sharded in `groups` interleaved blocks.

This module is pure data and arithmetic on shapes; it knows nothing of torch or source.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple


class DimsError(ValueError):
    """An annotation does not fit the traced shapes."""


class Factor(NamedTuple):
    """One factor of a dim (a tuple: a deep model's dims are hashed by the hundred thousand)."""

    label: str
    size: int


@dataclass
class TensorDims:
    tid: int
    dims: list[tuple[Factor, ...]]

    def where(self, label: str, local: dict[str, int] | None = None) -> tuple[int, int] | None:
        """(dim, groups) where `label` sits: groups is the product of the factors before it.
        `local`: labels whose size each device sees divided (the batch, sliced by data
        parallelism): a dim (batch heads) split on heads is `batch / slices` groups there."""
        if not local:       # the search asks each label of each tensor many times: kept per dims list
            cache = self.__dict__.get("_where_cache")
            if cache is None or cache[0] is not self.dims:      # (refine_factors assigns a new list)
                cache = self.__dict__["_where_cache"] = (self.dims, {})
            if label not in cache[1]:
                cache[1][label] = self._where(label, None)
            return cache[1][label]
        return self._where(label, local)

    def _where(self, label: str, local: dict[str, int] | None) -> tuple[int, int] | None:
        for d, factors in enumerate(self.dims):
            groups = 1
            for factor in factors:
                if factor.label == label:
                    return d, groups
                divisor = local.get(factor.label, 1) if local else 1
                groups *= factor.size // divisor if factor.size % divisor == 0 else factor.size
        return None

    def labels(self) -> set[str]:
        return {f.label for factors in self.dims for f in factors}


@dataclass
class OpDims:
    inputs: dict[str, TensorDims]           # operand name -> dims
    outputs: list[TensorDims]
    reduced: set[str] = field(default_factory=set)
    fixed: set[str] = field(default_factory=set)
    impl: dict[str, str] = field(default_factory=dict)
    shape_only: set[str] = field(default_factory=set)   # operands read for their shape or dtype only
    # of those, the dims whose size the results do not depend on: such an operand may arrive
    # split on them as it is (`create_causal_mask(config, inputs_embeds, ...)` reads the batch
    # size of inputs_embeds, not its hidden size)
    free: dict[str, set[int]] = field(default_factory=dict)
    # operand -> the results it reaches, where known (a cache update hands input i on as result
    # i); an operand missing here may reach every result
    feeds: dict[str, set[int]] = field(default_factory=dict)
    flops: tuple[tuple[str, ...], ...] = ()     # a fused op's multiply-adds (OpRule.flops)
    # what a split implementation (impl) communicates inside itself, per run of the op:
    # (collective, elements of the whole tensor, calls, whether in backward); a recurrent layer
    # all-gathers its hidden state at every step
    collectives: tuple[tuple[str, int, int, bool], ...] = ()

    def sizes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tensor in [*self.inputs.values(), *self.outputs]:
            for factors in tensor.dims:
                for f in factors:
                    out[f.label] = f.size
        return out

    def splittable(self) -> list[str]:
        """Labels that may be split, in first-seen order, without broadcast or literal factors."""
        seen: dict[str, None] = {}          # (a dict keeps the first-seen order)
        for tensor in [*self.inputs.values(), *self.outputs]:
            for factors in tensor.dims:
                for f in factors:
                    seen[f.label] = None
        out_labels = {f.label for t in self.outputs for factors in t.dims for f in factors}
        return [l for l in seen if l not in self.fixed and not l[0].isdigit()
                and (l in out_labels or l in self.reduced or l in self.impl)]


# ---- the annotation language -------------------------------------------------------------
# "arg0|input: *b k+, self.weight: n k+, self.bias?: n -> *b n"
_TOKEN = re.compile(r"\(([^)]*)\)|(\*?[A-Za-z_][A-Za-z_0-9]*[+^]?|\d+)")


@dataclass
class DimSpec:
    tokens: list[list[str]]     # per dim: factor tokens; a variadic dim is ["*name"]
    broadcast: bool = False     # `... dims`: leading dims may be missing, as broadcasting allows


@dataclass
class OperandSpec:
    names: list[str]            # aliases: positional "argN" and keyword names
    optional: bool
    dims: DimSpec


@dataclass
class Annotation:
    operands: list[OperandSpec]
    outputs: list[DimSpec]
    variadic_outputs: bool = False

    @classmethod
    def parse(cls, text: str) -> "Annotation":
        if "->" not in text:
            raise ValueError(f"annotation needs '->': {text!r}")
        left, right = text.split("->", 1)
        operands = []
        for part in filter(None, (p.strip() for p in left.split(","))):
            name, _, dims = part.partition(":")
            name = name.strip()
            optional = name.endswith("?")
            operands.append(OperandSpec(name.rstrip("?").split("|"), optional, _parse_dims(dims)))
        right = right.strip()
        variadic = right.startswith("[") and right.endswith("]...")
        if variadic:
            right = right[1:-4]
        # nothing after `->` is one scalar output (a loss)
        outputs = [_parse_dims(p) for p in right.split(",")] if right else [DimSpec([])]
        return cls(operands, outputs, variadic)


def _parse_dims(text: str) -> DimSpec:
    text = text.strip()
    broadcast = text.startswith("...")
    tokens = []
    for match in _TOKEN.finditer(text[3:] if broadcast else text):
        group, single = match.groups()
        tokens.append(group.split() if group is not None else [single])
    return DimSpec(tokens, broadcast)


def _strip(token: str) -> tuple[str, str]:
    if token[-1] in "+^":
        return token[:-1], token[-1]
    return token, ""


def bind(annotation: Annotation, shapes: dict[str, tuple[int, ...]], tids: dict[str, int],
         out_shapes: list[tuple[int, ...]], out_tids: list[int], known: dict[str, int] | None = None) -> OpDims:
    """Instantiate an annotation on the shapes of one invocation. `known`: sizes of labels that
    no tensor dim has alone (a head's size inside a fused `(h d)` projection), from plain arguments."""
    sizes: dict[str, int] = dict(known or {})
    result = OpDims({}, [])
    pending: list[tuple[str | None, DimSpec, tuple[int, ...], int]] = []
    for spec in annotation.operands:
        name = next((n for n in spec.names if n in shapes), None)
        if name is None:
            if spec.optional:
                continue
            raise DimsError(f"operand {spec.names[0]} is not a tensor here")
        pending.append((name, spec.dims, shapes[name], tids[name]))
    out_specs = annotation.outputs
    if annotation.variadic_outputs:
        out_specs = out_specs * len(out_shapes)
    if len(out_specs) != len(out_shapes):
        raise DimsError(f"expected {len(out_specs)} outputs, traced {len(out_shapes)}")
    pending += [(None, spec, shape, tid) for spec, shape, tid in zip(out_specs, out_shapes, out_tids)]
    variadic_len: dict[str, int] = {}
    # composite dims such as (g r) take their sizes from plain dims, so bind those first
    order = sorted(range(len(pending)), key=lambda i: any(len(t) > 1 for t in pending[i][1].tokens))
    bound: dict[int, list[tuple[Factor, ...]]] = {}
    for i in order:
        _, spec, shape, _ = pending[i]
        bound[i] = _bind_tensor(spec, shape, sizes, variadic_len, result)
    for name, spec, shape, _ in pending:
        if name is not None and name.startswith("self."):
            _no_broadcast_weight(name, spec, shape, sizes)
    for i, (name, _, _, tid) in enumerate(pending):
        if name is None:
            result.outputs.append(TensorDims(tid, bound[i]))
        else:
            result.inputs[name] = TensorDims(tid, bound[i])
    return result


def _no_broadcast_weight(name: str, spec: DimSpec, shape, sizes) -> None:
    """A layer's own weight of size 1 where its rule's dim is larger elsewhere does not
    broadcast: the rule does not describe this call (a depthwise convolution, groups = channels,
    has weights of o x 1 x kh x kw where the rule says o x c x kh x kw)."""
    if any(tokens[0].startswith("*") for tokens in spec.tokens) or len(spec.tokens) != len(shape):
        return
    for tokens, size in zip(spec.tokens, shape):
        if len(tokens) == 1 and not tokens[0].isdigit():
            label, _ = _strip(tokens[0])
            if size == 1 and sizes.get(label, 1) > 1:
                raise DimsError(f"{name} has size 1 where dim {label} is {sizes[label]}")


def _bind_tensor(spec: DimSpec, shape, sizes, variadic_len, result: OpDims) -> list[tuple[Factor, ...]]:
    token_list = spec.tokens
    fixed_count = sum(1 for t in token_list if not t[0].startswith("*"))
    if spec.broadcast and len(shape) < fixed_count:
        # An operand that broadcasts against the others (an attention mask of (s, t) for a
        # query of (b, h, s, d)) lacks leading dims: it has the rule's last ones.
        plain = [t for t in token_list if not t[0].startswith("*")]
        token_list = plain[len(plain) - len(shape):] if shape else []
        fixed_count = len(token_list)
    dims: list[tuple[Factor, ...]] = []
    position = 0
    for tokens in token_list:
        if tokens[0].startswith("*"):
            base, mark = _strip(tokens[0][1:])
            count = len(shape) - fixed_count
            if count < 0:
                raise DimsError(f"rank {len(shape)} is too small for {spec.tokens}")
            variadic_len[base] = max(variadic_len.get(base, 0), count)
            for i in range(count):
                label = f"{base}{count - 1 - i}"   # right-aligned, as broadcasting aligns
                dims.append(_factor(label, mark, shape[position], sizes, result))
                position += 1
            continue
        if position >= len(shape):
            raise DimsError(f"rank {len(shape)} does not match {spec.tokens}")
        dims.append(_factors(tokens, shape[position], sizes, result))
        position += 1
    if position != len(shape):
        raise DimsError(f"rank {len(shape)} does not match {spec.tokens}")
    return dims


def _factor(label, mark, size, sizes, result) -> tuple[Factor, ...]:
    if size == 1 and label not in sizes:
        return ()                              # a broadcast dim carries no label
    if label in sizes and sizes[label] != size:
        if size == 1:
            return ()
        if sizes[label] == 1:
            sizes[label] = size
        else:
            raise DimsError(f"dim {label} is {sizes[label]} in one tensor and {size} in another")
    sizes[label] = size
    if mark == "+":
        result.reduced.add(label)
    elif mark == "^":
        result.fixed.add(label)
    return (Factor(label, size),)


def _factors(tokens, size, sizes, result) -> tuple[Factor, ...]:
    if len(tokens) == 1:
        if tokens[0].isdigit():
            return (Factor(tokens[0], int(tokens[0])),) if size != 1 else ()
        label, mark = _strip(tokens[0])
        return _factor(label, mark, size, sizes, result)
    known, unknown = 1, []
    for token in tokens:
        label, _ = _strip(token)
        if token.isdigit():
            known *= int(token)
        elif label in sizes:
            known *= sizes[label]
        else:
            unknown.append(label)
    if size == 1 and not unknown and known != 1:
        return ()                              # broadcast, as a single label's size-1 dim is
    if len(unknown) > 1:
        raise DimsError(f"cannot infer the sizes of {tokens} from {size}")
    if unknown:
        if size % known:
            raise DimsError(f"{size} is not divisible into {tokens}")
        sizes[unknown[0]] = size // known
    elif known != size:
        raise DimsError(f"{tokens} is {known}, traced {size}")
    out = []
    for token in tokens:
        if token.isdigit():
            out.append(Factor(token, int(token)))
        else:
            label, mark = _strip(token)
            out.extend(_factor(label, mark, sizes[label], sizes, result))
    return tuple(out)

