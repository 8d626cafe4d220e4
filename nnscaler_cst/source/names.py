"""Names a piece of code reads or assigns: the liveness that cutting code apart needs
(pipeline stages hand on what later stages read; co-shard regions return what later code reads)."""
from __future__ import annotations

import libcst as cst


def names_in(nodes, store: bool) -> set[str]:
    """Every name the nodes mention (store=False), or only those they assign (store=True)."""
    found: set[str] = set()

    class Collect(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.add(name.value)

    class Targets(cst.CSTVisitor):
        def visit_AssignTarget(self, target):
            target.target.visit(Collect())

        def visit_AugAssign(self, node):
            node.target.visit(Collect())

        def visit_AnnAssign(self, node):
            node.target.visit(Collect())

        def visit_For(self, node):
            node.target.visit(Collect())

    for node in nodes:
        node.visit(Targets() if store else Collect())
    return found
