"""Variant classes: a block class whose instances are planned per group (plan/instances.py).

The class's grouped methods are rewritten once per group's edits. The first instance's rewrite
stays in the class itself; every other rewrite is written as a subclass right after it,
`class ConvBN_1(ConvBN):` holding only those methods, straight-line code with its collectives
written out as everywhere else. Instances whose rewrite is the class's own keep the class; the
others are named in a table (`INSTANCE_CLASSES`), and after build() each takes its variant as
its `__class__` (_comm.instance_classes): the library's constructors stay as they are.

Rewrites no model logic of its own (emit/rewrite.py does, once per group) and writes no file.
"""
from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ..materialize.edits import Edits, SiteEdit
from ..plan.instances import MethodGroups
from ..source.files import Span


@dataclass
class _Grouped:
    """One class's grouped methods and its instances, each with its group in every method."""

    cls: str
    methods: list[MethodGroups]
    kinds: dict[tuple[str, ...], list[str]]   # (group per method) -> the instances in those groups


def _by_class(methods: list[MethodGroups]) -> list[_Grouped]:
    classes: dict[str, list[MethodGroups]] = {}
    for method in methods:
        classes.setdefault(method.cls, []).append(method)
    out = []
    for cls, grouped in classes.items():
        instances = list(dict.fromkeys(path for m in grouped for group in m.groups for path in group))
        kinds: dict[tuple[str, ...], list[str]] = {}
        for path in instances:
            key = tuple(next((group[0] for group in m.groups if path in group), "") for m in grouped)
            kinds.setdefault(key, []).append(path)
        out.append(_Grouped(cls, grouped, kinds))
    return out


def _overlay(edits: Edits, grouped: _Grouped, kind: tuple[str, ...]) -> dict[Span, SiteEdit]:
    """The sites of the class's grouped methods as the instances of one kind have them."""
    sites: dict[Span, SiteEdit] = {}
    for method, group in zip(grouped.methods, kind):
        sites.update({span: site for span, site in edits.group_sites.get(group, {}).items()
                      if span.path == method.method.path and method.method.contains(span)})
    return sites


def _layers(grouped: _Grouped, kind: tuple[str, ...]) -> dict[Span, list[tuple[str, ...]]]:
    """The layers each nn.Sequential call of the class's grouped methods runs in the instances of
    one kind, where its instances run unlike lists (plan/instances.py)."""
    return {line: list(layers) for method, group in zip(grouped.methods, kind)
            for name, line, layers in method.layers if name == group}


def _class_def(module: cst.Module, name: str) -> tuple[int, cst.ClassDef] | None:
    return next(((k, s) for k, s in enumerate(module.body) if isinstance(s, cst.ClassDef) and s.name.value == name),
                None)


def _methods(module: cst.Module, cls: str, names: list[str]) -> list[cst.FunctionDef]:
    found = _class_def(module, cls)
    if found is None:
        return []
    body = found[1].body.body
    return [s for name in names for s in body if isinstance(s, cst.FunctionDef) and s.name.value == name][:len(names)]


class _SuperOfClass(cst.CSTTransformer):
    """`super()` in a method moved into a subclass names the class it was written in: the
    variant's `super().forward(x)` must still reach the original class's base."""

    def __init__(self, cls: str, first: str):
        super().__init__()
        self.args = [cst.Arg(cst.Name(cls)), cst.Arg(cst.Name(first))]

    def leave_Call(self, original, updated):
        if isinstance(updated.func, cst.Name) and updated.func.value == "super" and not updated.args:
            return updated.with_changes(args=self.args)
        return updated


def with_variants(source: cst.Module, edits: Edits, methods: list[MethodGroups], rewrite_once):
    """The file rewritten with one kind of each grouped class's instances in the class itself, and
    its Context: `variants` (class -> the subclasses to write after it, insert_variants) and
    `instance_classes` (instance -> its variant). `rewrite_once(edits, layers)` -> (module,
    Context), `layers` the nn.Sequential calls' layers as that kind runs them (_layers).
    The class keeps the first kind whose rewrite changes it (so that a mirror holds the class the
    variants derive from); a kind whose rewrite is the class's own keeps the class."""
    classes = _by_class(methods)
    rewrites: dict[str, list[tuple[list[str], tuple, tuple[str, ...], dict, object]]] = {}
    for grouped in classes:
        names = [m.name for m in grouped.methods]
        before = tuple(_text(m) for m in _methods(source, grouped.cls, names))
        for kind, instances in grouped.kinds.items():
            overlay, layers = _overlay(edits, grouped, kind), _layers(grouped, kind)
            module, ctx = rewrite_once(edits.overlaid(overlay), layers)
            methods_of_kind = _methods(module, grouped.cls, names)
            rewrites.setdefault(grouped.cls, []).append(
                (instances, tuple(_text(m) for m in methods_of_kind), methods_of_kind, overlay, ctx, layers))
        rewrites[grouped.cls].sort(key=lambda r: r[1] == before)     # a kind that changes the class first
    first = {span: site for kinds in rewrites.values() for span, site in kinds[0][3].items()}
    module, ctx = rewrite_once(edits.overlaid(first), {line: layers for kinds in rewrites.values()
                                                       for line, layers in kinds[0][5].items()})
    taken = {s.name.value for s in module.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))}
    for cls, kinds in rewrites.items():
        own = kinds[0][1]
        made: dict[tuple, str] = {}          # rewritten methods' text -> variant class
        for instances, text, rewritten, _, kind_ctx, _ in kinds[1:]:
            if text == own:
                continue
            if text not in made:
                name = next(f"{cls}_{k}" for k in range(1, 1000) if f"{cls}_{k}" not in taken)
                taken.add(name)
                made[text] = name
                ctx.used |= kind_ctx.used
                ctx.needs_torch |= kind_ctx.needs_torch
                ctx.variants.setdefault(cls, []).append(_variant_class(name, cls, rewritten, instances))
            for path in instances:
                ctx.instance_classes[path] = made[text]
    return module, ctx


def insert_variants(module: cst.Module, variants: dict[str, list[cst.ClassDef]]) -> cst.Module:
    """The module with each class's variants right after it."""
    if not variants:
        return module
    body = []
    for statement in module.body:
        body.append(statement)
        if isinstance(statement, cst.ClassDef):
            body += variants.get(statement.name.value, [])
    return module.with_changes(body=body)


def _text(method: cst.FunctionDef) -> str:
    return cst.Module([method]).code


def _variant_class(name: str, cls: str, methods: list[cst.FunctionDef], instances: list[str]) -> cst.ClassDef:
    more = f" (and {len(instances) - 1} more)" if len(instances) > 1 else ""
    comment = (f"# {cls} as {instances[0]}{more} runs it: that instance's own splits of "
               f"{', '.join(m.name.value for m in methods)} (set as its class after build())")
    body = []
    for method in methods:
        params = method.params.params
        first = params[0].name.value if params else "self"
        body.append(method.visit(_SuperOfClass(cls, first)).with_changes(leading_lines=[] if not body else
                                                                          method.leading_lines))
    return cst.ClassDef(cst.Name(name), cst.IndentedBlock(body), bases=[cst.Arg(cst.Name(cls))],
                        leading_lines=[cst.EmptyLine(), cst.EmptyLine(), cst.EmptyLine(comment=cst.Comment(comment))])
