"""Op rules from rules/ops/*.toml: how each callee a model file may call can be split.

A rule is keyed by the callee the model file called (a torch function or Tensor method, an
nn.Module type, or a library helper such as transformers' Conv1D or its attention dispatch)
and gives either a `dims` annotation or a computed `kind`. This module loads and matches
rules and binds them to traced invocations; it does not decide any split.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Location, UserError, display_path, toml_error
from ..rules_path import builtin_rules_dir, rules_dirs
from ..trace.records import Node, TensorList, Trace
from ..trace.naming import qualified_type, short_type, traced_split
from .dims import Annotation, DimsError, OpDims, TensorDims, bind
from .kinds import KINDS, Call

RULES_DIR = builtin_rules_dir()


@dataclass
class OpRule:
    name: str
    callees: list[str]
    location: Location
    annotation: Annotation | None = None
    kind: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    impl: dict[str, str] = field(default_factory=dict)       # label -> _comm function splitting it
    partial: dict[str, str] = field(default_factory=dict)    # {"expr": ..., "bias": operand}
    # a fused op's multiply-adds, as products of its labels ("b g r s t d + b g r s t e": attention's
    # two matmuls); the cost model prices it as a contraction of 2 FLOPs per multiply-add
    flops: tuple[tuple[str, ...], ...] = ()

    def instantiate(self, call: Call) -> OpDims:
        if self.annotation is not None:
            dims = bind(self.annotation, call.shapes, call.tids, call.out_shapes, call.out_tids)
        else:
            dims = KINDS[self.kind](call, **self.options)
        dims.impl = dict(self.impl)
        dims.flops = self.flops or dims.flops      # a kind may count its own (a recurrent layer's steps)
        return dims


@dataclass
class CtorRule:
    """Which constructor argument sets which dim of each parameter it creates."""

    type: str
    params: dict[str, list[list[str]]]   # attr -> per dim: argument aliases (["arg1", "out_features"])
    location: Location
    # argument name -> other arguments divided with it where the layer holds them at the same
    # size (a depthwise conv's in_channels and groups, split with its out_channels)
    same_size: dict[str, list[list[str]]] = field(default_factory=dict)

    def divided_with(self, aliases: list[str]) -> list[list[str]]:
        """The aliases of the arguments divided with the argument of `aliases` when they hold the
        same size."""
        return [other for a in aliases for other in self.same_size.get(a, [])]


@dataclass
class RuleSet:
    ops: dict[str, OpRule]
    ctors: dict[str, CtorRule]
    library_modules: tuple[str, ...]
    # modules of torch or a library whose code is traced line by line and mirrored as the model's
    # own (torch.nn's transformer layers: split as the layers they are, their block loops pipelined)
    traced_modules: tuple[str, ...] = ()

    @property
    def traced_module_names(self) -> frozenset[str]:
        """The modules holding what `traced` names (a module, or one class of a module)."""
        return traced_split(self.traced_modules)[0]

    def rule_for(self, callee: str) -> OpRule | None:
        return self.ops.get(callee)

    def ctor_for(self, module_type: str) -> CtorRule | None:
        """The [[ctor]] rule of a module type, or of the nearest base class with one when the
        subclass takes the arguments that rule names at the same places (a scaled or learned
        nn.Embedding subclass, say)."""
        if module_type in self.ctors:
            return self.ctors[module_type]
        cls = _class_named(module_type)
        for base in (cls.__mro__[1:] if cls is not None else ()):
            rule = self.ctors.get(short_type(qualified_type(base)))
            if rule is not None:
                return rule if _same_arguments(cls, base, rule) else _through_super_call(cls, base, rule)
        return None

    def size_attributes(self, module_type: str) -> dict[str, list[set[str]]]:
        """Per parameter of a module type, per dim: the names of the constructor arguments that
        set that dim (its [[ctor]] rule's and its bases'), which the layer also keeps as
        attributes (`self.out_channels`). A forward reading one (`self.weight.reshape(1,
        self.out_channels, -1)`) reads the local size once the rewrite divides the argument."""
        names: dict[str, list[set[str]]] = {}
        cls = _class_named(module_type)
        rules = [self.ctor_for(module_type)] + [self.ctors.get(short_type(qualified_type(b)))
                                                for b in (cls.__mro__[1:] if cls is not None else ())]
        for rule in filter(None, rules):
            for param, per_dim in rule.params.items():
                dims = names.setdefault(param, [set() for _ in per_dim])
                for d, aliases in enumerate(per_dim[:len(dims)]):
                    for names_of in [aliases, *rule.divided_with(aliases)]:
                        dims[d].update(a for a in names_of
                                       if a.isidentifier() and not (a.startswith("arg") and a[3:].isdigit()))
        return names


def load_rules(rules_dir: Path | None = None) -> RuleSet:
    """The op rules of `rules_dir`, or of every rules folder (rules_path.py): the built-in ones
    first, so that a user's rule for the same callee wins."""
    ops: dict[str, OpRule] = {}
    ctors: dict[str, CtorRule] = {}
    library: list[str] = []
    traced: list[str] = []
    folders = [rules_dir] if rules_dir is not None else rules_dirs()[::-1]
    for path in [p for folder in folders for p in sorted((folder / "ops").glob("*.toml"))]:
        text = path.read_text()
        shown = display_path(path)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise toml_error(exc, path, text) from None
        library += data.get("library", {}).get("modules", [])
        traced += data.get("library", {}).get("traced", [])
        for entry in data.get("op", []):
            location = Location(shown, _line_of(text, entry["callee"][0]))
            try:
                rule = OpRule(
                    name=entry.get("name", entry["callee"][0].rsplit(".", 1)[-1]),
                    callees=entry["callee"], location=location,
                    annotation=Annotation.parse(entry["dims"]) if "dims" in entry else None,
                    kind=entry.get("kind"), options=entry.get("options", {}),
                    impl=entry.get("impl", {}), partial=entry.get("partial", {}),
                    flops=_flops_terms(entry.get("flops", "")))
            except (KeyError, ValueError) as exc:
                raise UserError(f"bad op rule: {exc}", location,
                                hint='e.g. dims = "arg0|input: *b k+, self.weight: n k+ -> *b n" '
                                '(see rules/ops/torch_nn.toml)') from None
            if rule.annotation is None and rule.kind not in KINDS:
                raise UserError(f"op rule needs `dims` or a `kind` among {sorted(KINDS)}", location,
                                hint='add dims = "..." (an annotation) or kind = "elementwise" (say)')
            for callee in rule.callees:
                ops[callee] = rule
        for entry in data.get("ctor", []):
            location = Location(shown, _line_of(text, entry["type"]))
            params = {k: [a.split("|") for a in v] for k, v in entry.items() if k not in ("type", "same_size")}
            same_size = {k: [a.split("|") for a in v] for k, v in entry.get("same_size", {}).items()}
            ctors[entry["type"]] = CtorRule(entry["type"], params, location, same_size)
    return RuleSet(ops, ctors, tuple(library), tuple(traced))


def _class_named(qualified: str) -> type | None:
    module_name, _, name = qualified.rpartition(".")
    while module_name:
        module = sys.modules.get(module_name)
        if module is not None:
            found = module
            for part in name.split("."):
                found = getattr(found, part, None)
            return found if isinstance(found, type) else None
        module_name, _, head = module_name.rpartition(".")
        name = f"{head}.{name}"
    return None


def _positional_names(cls: type) -> list[str]:
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _same_arguments(cls: type, base: type, rule: CtorRule) -> bool:
    """Whether every argument the rule reads sits at the same position, by the same name, in both."""
    ours, theirs = _positional_names(cls), _positional_names(base)
    for per_dim in rule.params.values():
        for aliases in per_dim:
            for alias in aliases:
                if alias.startswith("arg") and alias[3:].isdigit():
                    k = int(alias[3:])
                    if k >= len(ours) or k >= len(theirs) or ours[k] != theirs[k]:
                        return False
    return True


def _through_super_call(cls: type, base: type, rule: CtorRule) -> CtorRule | None:
    """The rule in the subclass's own arguments, when its __init__ hands them to the base's
    (`super().__init__(num_positions, embedding_dim, padding_idx)` under other names); None
    when an argument the rule reads does not come straight from one of the subclass's."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError, SyntaxError):
        return None
    ours, theirs = _positional_names(cls), _positional_names(base)
    handed: dict[str, str] = {}                     # base argument name -> the subclass's argument
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "__init__":
            explicit = not (isinstance(call.func.value, ast.Call) and getattr(call.func.value.func, "id", "") == "super")
            args = call.args[1:] if explicit else call.args       # `Base.__init__(self, ...)`
            for k, arg in enumerate(args):
                if isinstance(arg, ast.Name) and k < len(theirs):
                    handed[theirs[k]] = arg.id
            for keyword in call.keywords:
                if keyword.arg and isinstance(keyword.value, ast.Name):
                    handed[keyword.arg] = keyword.value.id
    params: dict[str, list[list[str]]] = {}
    for attr, per_dim in rule.params.items():
        params[attr] = []
        for aliases in per_dim:
            names = {theirs[int(a[3:])] if a.startswith("arg") and a[3:].isdigit() and int(a[3:]) < len(theirs)
                     else a for a in aliases}
            mine = {handed[n] for n in names if n in handed}
            if len(mine) != 1 or next(iter(mine)) not in ours:
                return None
            name = next(iter(mine))
            params[attr].append([f"arg{ours.index(name)}", name])
    return CtorRule(short_type(qualified_type(cls)), params, rule.location)


def _line_of(text: str, needle: str) -> int:
    for number, line in enumerate(text.splitlines(), 1):
        if f'"{needle}"' in line:
            return number
    return 1


def call_of(node: Node, trace: Trace) -> Call:
    shapes, tids, values, lists = {}, {}, {}, {}
    for operand in node.operands:
        if operand.tid is not None:
            shapes[operand.name] = trace.tensors[operand.tid].shape
            tids[operand.name] = operand.tid
        elif isinstance(operand.value, TensorList):
            lists[operand.name] = list(operand.value)
            values[f"{operand.name}.shapes"] = [trace.tensors[t].shape for t in operand.value]
        else:
            values[operand.name] = operand.value
    replay = trace.replays.get(node.index)
    module = replay.module if replay is not None else None
    if module is not None:      # a layer's plain settings, as `self.NAME` (nn.LSTM's batch_first)
        values.update({f"self.{name}": value for name, value in vars(module).items()
                       if not name.startswith("_") and type(value) in (bool, int, float, str)})
    return Call(shapes, tids, values, [trace.tensors[t].shape for t in node.outputs], list(node.outputs), lists)


def annotate(node: Node, trace: Trace, rules: RuleSet,
             seen: dict | None = None) -> tuple[OpRule | None, OpDims | None, str | None]:
    """(rule, dims, problem): dims is None when no rule matches or the rule does not fit.
    `seen`: the dims of earlier calls by what they depend on (see _call_key), kept by the caller:
    a call equal to one seen up to its tensor ids gets a copy with its own ids."""
    rule = rules.rule_for(node.callee)
    if rule is None:
        return None, None, "no rule"
    call = call_of(node, trace)
    key = _call_key(rule, call) if seen is not None else None
    if key is not None and key[0] in seen:
        template, tids = seen[key[0]]
        return rule, _with_tids(template, dict(zip(tids, key[1]))), None
    try:
        dims = rule.instantiate(call)
    except (DimsError, KeyError, IndexError, TypeError) as exc:
        return rule, None, f"rule {rule.name} does not fit: {exc}"
    if key is not None:
        seen[key[0]] = (_with_tids(dims, {}), key[1])      # a copy: the graph's may be refined later
    return rule, dims, None


def _call_tids(call: Call) -> list[int]:
    return [*call.tids.values(), *call.out_tids, *(t for tids in call.lists.values() for t in tids)]


def _call_key(rule: OpRule, call: Call) -> tuple[tuple, list[int]] | None:
    """(what a rule's dims depend on: the call's operand names, shapes and plain values, which of
    its tensors are the same; its tensor ids), or None when a value has no exact key."""
    tids = _call_tids(call)
    first: dict[int, int] = {}
    try:
        key = (id(rule), tuple(call.shapes.items()), tuple(call.out_shapes),
               tuple((name, len(tids_)) for name, tids_ in call.lists.items()),
               tuple(first.setdefault(t, len(first)) for t in tids),
               tuple((name, _exact(value)) for name, value in call.values.items()))
        hash(key)
    except TypeError:
        return None
    return key, tids


def _exact(value):
    """A key equal only for equal values of the same types (1, 1.0 and True are equal in Python)."""
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_exact(v) for v in value)
    if isinstance(value, float):
        return "float", repr(value)
    if isinstance(value, dict):
        return "dict", tuple((_exact(k), _exact(v)) for k, v in value.items())
    return type(value), value


def _with_tids(dims: OpDims, tids: dict[int, int]) -> OpDims:
    """A copy of `dims` with tensor ids mapped (those not in `tids` kept), sharing no mutable part
    with it; tensors and dim lists shared inside it stay shared in the copy."""
    tensors: dict[int, TensorDims] = {}
    lists: dict[int, list] = {}

    def tensor(t: TensorDims) -> TensorDims:
        if id(t) not in tensors:
            if id(t.dims) not in lists:
                lists[id(t.dims)] = list(t.dims)
            tensors[id(t)] = TensorDims(tids.get(t.tid, t.tid), lists[id(t.dims)])
        return tensors[id(t)]
    return dataclasses.replace(
        dims, inputs={name: tensor(t) for name, t in dims.inputs.items()}, outputs=[tensor(t) for t in dims.outputs],
        reduced=set(dims.reduced), fixed=set(dims.fixed), impl=dict(dims.impl), shape_only=set(dims.shape_only),
        free={k: set(v) for k, v in dims.free.items()}, feeds={k: set(v) for k, v in dims.feeds.items()})


def _flops_terms(text: str) -> tuple[tuple[str, ...], ...]:
    """`flops = "b g r s t d + b g r s t e"`: per term, the labels whose sizes multiply ("*b": every
    label the annotation's `*b` binds)."""
    terms = tuple(tuple(term.split()) for term in text.split("+")) if text.strip() else ()
    if any(not term for term in terms):
        raise ValueError(f"flops = {text!r}: each term is labels separated by spaces, terms by +")
    return terms
