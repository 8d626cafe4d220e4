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

        def visit_Attribute(self, node: cst.Attribute) -> bool:
            node.value.visit(self)      # `self.h` reads self; h is no variable
            return False

    def bound(target: cst.BaseExpression) -> None:
        """The names an assignment target binds: names, and the tensor a write by index changes
        (`x[i] = v`: x is handed on like a new value). An attribute target (`self.pe = ...`)
        binds no name: it changes an object's state, which is no variable of this code."""
        if isinstance(target, cst.Name):
            found.add(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                bound(element.value)
        elif isinstance(target, cst.StarredElement):
            bound(target.value)
        elif isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name):
            found.add(target.value.value)

    class Targets(cst.CSTVisitor):
        def visit_AssignTarget(self, target):
            bound(target.target)

        def visit_AugAssign(self, node):
            bound(node.target)

        def visit_AnnAssign(self, node):
            bound(node.target)

        def visit_For(self, node):
            bound(node.target)

        def visit_NamedExpr(self, node):
            bound(node.target)

    for node in nodes:
        node.visit(Targets() if store else Collect())
    return found


def exposed_reads(statements) -> set[str]:
    """Names the statements read before assigning them on every path to the read (upward-exposed
    uses): what must already hold a value when the statements start. A name assigned under an
    `if` and read only after that assignment in the same branch is not exposed."""
    exposed: set[str] = set()
    _scan(list(statements), set(), exposed)
    return exposed


def _scan(statements, defined: set[str], exposed: set[str]) -> set[str]:
    """Adds the exposed reads of `statements` to `exposed`; returns the names defined after them."""
    for stmt in statements:
        if isinstance(stmt, cst.If):
            exposed |= names_in([stmt.test], False) - defined
            after_body = _scan(stmt.body.body, set(defined), exposed)
            other = stmt.orelse
            if other is None:
                after_else = defined
            elif isinstance(other, cst.If):
                after_else = _scan([other], set(defined), exposed)
            else:
                after_else = _scan(other.body.body, set(defined), exposed)
            defined = defined | (after_body & after_else)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                exposed |= _reads(small) - defined
                defined = defined | names_in([small], True)
        elif isinstance(stmt, cst.With) and isinstance(stmt.body, cst.IndentedBlock):
            # a `with` body runs once, after its items: read in order like plain statements
            exposed |= names_in(list(stmt.items), False) - defined
            defined = _scan(stmt.body.body, defined | names_in(list(stmt.items), True), exposed)
        else:                      # loops, try: every name inside counts as read on entry
            exposed |= names_in([stmt], False) - defined
            defined = defined | names_in([stmt], True)
    return defined


def _reads(small: cst.BaseSmallStatement) -> set[str]:
    """Names a small statement reads: an assignment reads its value and the bases of subscript or
    attribute targets (`x[i] = v` reads x), not the plain names it binds."""
    if isinstance(small, (cst.Assign, cst.AnnAssign)):
        targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
        reads = names_in([small.value], False) if small.value is not None else set()
        for target in targets:
            if not _binds_names_only(target):
                reads |= names_in([target], False)
        return reads
    return names_in([small], False)


def _binds_names_only(target: cst.BaseExpression) -> bool:
    if isinstance(target, cst.Name):
        return True
    if isinstance(target, (cst.Tuple, cst.List)):
        return all(_binds_names_only(e.value) for e in target.elements)
    return False



def bound_on_every_path(statements, bound: set[str]) -> set[str] | None:
    """The names bound after `statements` on every path through them that goes on after them,
    given those bound before (definite assignment); None when no path does (each returns or
    raises). An `if` binds what each of its branches that goes on binds, a loop nothing (it may
    run no pass), a `with` what its body binds; a statement that may `continue` or `break` the
    loop around the statements ends what counts. Conservative: a name left out may be bound."""
    bound = set(bound)
    for stmt in statements:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Return, cst.Raise)):
                    return None
                if isinstance(small, (cst.Continue, cst.Break)):
                    return bound
                if isinstance(small, cst.Assign):
                    for target in small.targets:
                        bound |= _plain_names(target.target)
                elif isinstance(small, cst.AnnAssign) and small.value is not None:
                    bound |= _plain_names(small.target)
                elif isinstance(small, cst.AugAssign):
                    bound |= _plain_names(small.target)
                elif isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
                    for alias in small.names:
                        name = alias.asname.name if alias.asname is not None else alias.name
                        while isinstance(name, cst.Attribute):      # `import a.b` binds a
                            name = name.value
                        if isinstance(name, cst.Name):
                            bound.add(name.value)
                elif isinstance(small, cst.Del):
                    bound -= _plain_names(small.target)
            continue
        if _may_leave_the_loop(stmt):
            return bound
        if isinstance(stmt, cst.If):
            branches = [bound_on_every_path(stmt.body.body, bound)]
            other = stmt.orelse
            if other is None:
                branches.append(bound)
            elif isinstance(other, cst.If):
                branches.append(bound_on_every_path([other], bound))
            else:
                branches.append(bound_on_every_path(other.body.body, bound))
            going_on = [b for b in branches if b is not None]
            if not going_on:
                return None
            bound = bound | set.intersection(*going_on)
        elif isinstance(stmt, cst.With) and isinstance(stmt.body, cst.IndentedBlock):
            for item in stmt.items:
                if item.asname is not None:
                    bound |= _plain_names(item.asname.name)
            after = bound_on_every_path(stmt.body.body, bound)
            if after is None:
                return None
            bound = after
        elif isinstance(stmt, cst.Try):
            after = bound_on_every_path(stmt.body.body, bound)
            if after is not None and stmt.orelse is not None:
                after = bound_on_every_path(stmt.orelse.body.body, after)
            going_on = [b for b in [after, *(bound_on_every_path(h.body.body, bound) for h in stmt.handlers)]
                        if b is not None]
            if not going_on:
                return None
            bound = bound | set.intersection(*going_on)
            if stmt.finalbody is not None:
                bound = bound_on_every_path(stmt.finalbody.body.body, bound)
                if bound is None:
                    return None
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            bound.add(stmt.name.value)
        # loops and the rest bind nothing for sure
    return bound


def _plain_names(target: cst.BaseExpression) -> set[str]:
    """The plain names an assignment target binds (`a, (b, *c) = ...`), not `x[i]` or `x.y`."""
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(_plain_names(e.value) for e in target.elements))
    if isinstance(target, cst.StarredElement):
        return _plain_names(target.value)
    return set()


def _may_leave_the_loop(stmt) -> bool:
    """Whether a compound statement holds a `continue` or `break` of the loop around it (not of
    a loop, or in a function, nested in it)."""
    found = []

    class Find(cst.CSTVisitor):
        def visit_Continue(self, node):
            found.append(node)

        def visit_Break(self, node):
            found.append(node)

        def visit_For(self, node):
            return False

        def visit_While(self, node):
            return False

        def visit_FunctionDef(self, node):
            return False

        def visit_ClassDef(self, node):
            return False

    stmt.visit(Find())
    return bool(found)
