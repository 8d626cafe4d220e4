"""Constructors that read another module's size: `width = self.tok.embedding_dim`.

A module whose parameters are split is built with divided constructor arguments, so its own
size attributes (`embedding_dim`, `out_features`) hold local sizes on every rank. Code that
builds other modules from them (fairseq-style `embed_dim = embed_tokens.embedding_dim`, or
`nn.Linear(width, 4 * width)`) expects the full size: each such read in an `__init__` is
rewritten to the full size, `(self.tok.embedding_dim * 2)`, and the usual constructor edits
divide what must be local. Decides which reads; writes no source.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import libcst as cst

from ..graph.graph import Graph
from ..plan.layouts import R, Layout
from ..source.files import Span


def full_size_reads(graph: Graph, param_layout: dict[str, Layout], n: int) -> dict[Span, int]:
    """Span of each `self.X.attr` read in an `__init__` that holds a split size -> the factor."""
    local = _local_size_attributes(graph, param_layout)
    if not local:
        return {}
    classes: dict[str, list[str]] = defaultdict(list)          # qualified class -> module paths
    for path, qualified in graph.trace.module_types.items():
        classes[qualified].append(path)
    reads: dict[Span, int] = {}
    own = {str(Path(f).resolve()) for f in graph.trace.own_files}
    for qualified, paths in classes.items():
        module_name, _, class_name = qualified.rpartition(".")
        found = _class_source(graph, own, module_name, class_name)
        if found is None:
            continue
        source, class_def = found
        for function in class_def.body.body:
            if not (isinstance(function, cst.FunctionDef) and function.name.value == "__init__"):
                continue
            for read, holder in _self_attribute_reads(function):
                attr = read.attr.value
                owners = [f"{p}.{holder}" if p else holder for p in paths]
                if all((owner, attr) in local for owner in owners):
                    reads[source.span_of(read)] = n
    return reads


def _local_size_attributes(graph: Graph, param_layout: dict[str, Layout]) -> set[tuple[str, str]]:
    """(module path, attribute) pairs naming a constructor argument behind a split dim."""
    out = set()
    for name, info in graph.trace.params.items():
        layout = param_layout.get(name, R)
        rule = graph.rules.ctor_for(info.module_type) if layout.kind == "S" else None
        per_dim = rule.params.get(info.attr) if rule else None
        if not per_dim or per_dim == [["*"]] or layout.dim >= len(per_dim):
            continue
        for alias in (*info.aliases, name):
            owner = alias.rsplit(".", 1)[0] if "." in alias else ""
            out |= {(owner, a) for a in per_dim[layout.dim] if not (a.startswith("arg") and a[3:].isdigit())}
    return out


def _class_source(graph: Graph, own: set[str], module_name: str, class_name: str):
    """The class's definition, when it sits at the top of one of the files the rewrite owns."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if path is None or str(Path(path).resolve()) not in own:
        return None
    source = graph.sources.get(path)
    for statement in source.module.body:
        if isinstance(statement, cst.ClassDef) and statement.name.value == class_name:
            return source, statement
    return None


def _self_attribute_reads(function: cst.FunctionDef) -> list[tuple[cst.Attribute, str]]:
    """`self.X.attr` or `self.X.Y.attr` read (not assigned) anywhere in the function, with the
    holder's path from self ("X", "X.Y"): `nn.Buffer(torch.zeros(1, self.model.shared.num_embeddings))`."""
    class Reads(cst.CSTVisitor):
        def __init__(self):
            self.found: list[tuple[cst.Attribute, str]] = []
            self.targets: set[int] = set()

        def visit_AssignTarget(self, node):
            self.targets.add(id(node.target))

        def visit_Attribute(self, node):
            names, inner = [], node.value
            while isinstance(inner, cst.Attribute):
                names.append(inner.attr.value)
                inner = inner.value
            if id(node) not in self.targets and names and isinstance(inner, cst.Name) and inner.value == "self":
                self.found.append((node, ".".join(reversed(names))))

    reads = Reads()
    function.visit(reads)
    return reads.found
