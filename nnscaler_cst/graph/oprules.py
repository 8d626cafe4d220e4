"""Op rules from rules/ops/*.toml: how each callee a model file may call can be split.

A rule is keyed by the callee the model file called (a torch function or Tensor method, an
nn.Module type, or a library helper such as transformers' Conv1D or its attention dispatch)
and gives either a `dims` annotation or a computed `kind`. This module loads and matches
rules and binds them to traced invocations; it does not decide any split.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Location, UserError, display_path
from ..trace.records import Node, TensorList, Trace
from .dims import Annotation, DimsError, OpDims, bind
from .kinds import KINDS, Call

RULES_DIR = Path(__file__).resolve().parents[2] / "rules"


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

    def instantiate(self, call: Call) -> OpDims:
        if self.annotation is not None:
            dims = bind(self.annotation, call.shapes, call.tids, call.out_shapes, call.out_tids)
        else:
            dims = KINDS[self.kind](call, **self.options)
        dims.impl = dict(self.impl)
        return dims


@dataclass
class CtorRule:
    """Which constructor argument sets which dim of each parameter it creates."""

    type: str
    params: dict[str, list[list[str]]]   # attr -> per dim: argument aliases (["arg1", "out_features"])
    location: Location


@dataclass
class RuleSet:
    ops: dict[str, OpRule]
    ctors: dict[str, CtorRule]
    library_modules: tuple[str, ...]

    def rule_for(self, callee: str) -> OpRule | None:
        return self.ops.get(callee)


def load_rules(rules_dir: Path = RULES_DIR) -> RuleSet:
    ops: dict[str, OpRule] = {}
    ctors: dict[str, CtorRule] = {}
    library: list[str] = []
    for path in sorted((rules_dir / "ops").glob("*.toml")):
        text = path.read_text()
        shown = display_path(path)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"invalid TOML: {exc}", Location(shown, getattr(exc, "lineno", 1),
                                                              getattr(exc, "colno", 1) - 1)) from None
        library += data.get("library", {}).get("modules", [])
        for entry in data.get("op", []):
            location = Location(shown, _line_of(text, entry["callee"][0]))
            try:
                rule = OpRule(
                    name=entry.get("name", entry["callee"][0].rsplit(".", 1)[-1]),
                    callees=entry["callee"], location=location,
                    annotation=Annotation.parse(entry["dims"]) if "dims" in entry else None,
                    kind=entry.get("kind"), options=entry.get("options", {}),
                    impl=entry.get("impl", {}), partial=entry.get("partial", {}))
            except (KeyError, ValueError) as exc:
                raise UserError(f"bad op rule: {exc}", location) from None
            if rule.annotation is None and rule.kind not in KINDS:
                raise UserError(f"op rule needs `dims` or a `kind` among {sorted(KINDS)}", location)
            for callee in rule.callees:
                ops[callee] = rule
        for entry in data.get("ctor", []):
            location = Location(shown, _line_of(text, entry["type"]))
            params = {k: [a.split("|") for a in v] for k, v in entry.items() if k != "type"}
            ctors[entry["type"]] = CtorRule(entry["type"], params, location)
    return RuleSet(ops, ctors, tuple(library))


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
    return Call(shapes, tids, values, [trace.tensors[t].shape for t in node.outputs], list(node.outputs), lists)


def annotate(node: Node, trace: Trace, rules: RuleSet) -> tuple[OpRule | None, OpDims | None, str | None]:
    """(rule, dims, problem): dims is None when no rule matches or the rule does not fit."""
    rule = rules.rule_for(node.callee)
    if rule is None:
        return None, None, "no rule"
    try:
        return rule, rule.instantiate(call_of(node, trace)), None
    except (DimsError, KeyError, IndexError, TypeError) as exc:
        return rule, None, f"rule {rule.name} does not fit: {exc}"
