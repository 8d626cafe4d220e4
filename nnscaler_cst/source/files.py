"""Parsed source files and the index from a code position to its LibCST node.

Parses only; never executes the user's code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from ..errors import Location, UserError, display_path


@dataclass(frozen=True, order=True)
class Span:
    """A source range: 1-based lines, 0-based character columns, end exclusive."""

    path: str
    line: int
    col: int
    end_line: int
    end_col: int
    via: tuple[str, ...] = ()   # a child of the nn.Sequential called here: ("1",) is `head[1]`

    def __hash__(self) -> int:
        # the dataclass's own hash (of the fields), computed once: the planner keys its tables by
        # site, (span, callee), and looks them up millions of times for a 96-layer model
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.path, self.line, self.col, self.end_line, self.end_col, self.via))
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self):            # a hash is per process (string hashing is salted)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def start(self) -> Location:
        return Location(display_path(self.path), self.line, self.col)

    def __str__(self) -> str:
        return str(self.start)

    @property
    def label(self) -> str:
        """path:line:col (1-based column), with the layer of an nn.Sequential call: `m.py:9:5[1]`."""
        layer = "".join(f"[{v}]" if v.isdigit() else f".{v}" for v in self.via)
        return f"{display_path(self.path)}:{self.line}:{self.col + 1}{layer}"

    def contains(self, other: "Span") -> bool:
        return (self.line, self.col) <= (other.line, other.col) and (other.end_line, other.end_col) <= (
            self.end_line, self.end_col)


# Expression nodes a traced call can be attributed to.
_CALLISH = (cst.Call, cst.BinaryOperation, cst.UnaryOperation, cst.Subscript, cst.Comparison,
            cst.AugAssign, cst.Attribute, cst.BooleanOperation)


@dataclass
class SourceFile:
    path: Path
    text: str
    module: cst.Module
    wrapper: MetadataWrapper = field(repr=False)

    @classmethod
    def parse(cls, path: Path) -> "SourceFile":
        text = path.read_text(encoding="utf-8")
        try:
            module = cst.parse_module(text)
        except cst.ParserSyntaxError as exc:
            # Python's own compiler (compiling does not run anything) places the error where the
            # user expects it, e.g. at an unclosed `(`; LibCST reports where its parser gave up.
            message, where = exc.message, Location(display_path(path), exc.raw_line, exc.raw_column)
            try:
                compile(text, str(path), "exec", dont_inherit=True)
            except SyntaxError as py_exc:
                message = py_exc.msg
                where = Location(display_path(path), py_exc.lineno or 1, max((py_exc.offset or 1) - 1, 0))
            raise UserError(f"syntax error: {message}", where,
                            hint="fix the syntax error; the file must be valid Python") from None
        return cls(path, text, module, MetadataWrapper(module, unsafe_skip_copy=True))

    @cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines(keepends=True)

    @cached_property
    def positions(self):
        return self.wrapper.resolve(PositionProvider)

    @cached_property
    def parents(self) -> dict[cst.CSTNode, cst.CSTNode]:
        """Each node's parent (what ParentNodeProvider gives, read from the tree directly: a third
        of the time, and a transformers model file is thousands of nodes)."""
        out: dict[cst.CSTNode, cst.CSTNode] = {}
        stack: list[cst.CSTNode] = [self.module]
        while stack:
            node = stack.pop()
            for child in node.children:
                out[child] = node
                stack.append(child)
        return out

    def value_is_whole(self, node: cst.CSTNode) -> bool:
        """Whether an expression's value is used as it is: not unpacked, not indexed into."""
        parent = self.parents.get(node)
        if isinstance(parent, cst.Assign):
            return not any(isinstance(t.target, (cst.Tuple, cst.List)) for t in parent.targets)
        if isinstance(parent, cst.Subscript) and parent.value is node:
            return False
        if isinstance(parent, (cst.Return, cst.Expr)):
            return True
        return True

    def value_is_stored(self, node: cst.CSTNode) -> bool:
        """Whether an expression's value is assigned to an attribute (`self.pe = pe.to(x.dtype)`):
        it outlives the call, and the next call reads what was stored."""
        parent = self.parents.get(node)
        if isinstance(parent, cst.AssignTarget):
            parent = self.parents.get(parent)
        if isinstance(parent, cst.Assign) and parent.value is node:
            return any(isinstance(t.target, cst.Attribute) for t in parent.targets)
        if isinstance(parent, cst.AnnAssign) and parent.value is node:
            return isinstance(parent.target, cst.Attribute)
        return False

    @cached_property
    def _index(self) -> dict[tuple[int, int, int, int], list[cst.CSTNode]]:
        index: dict[tuple[int, int, int, int], list[cst.CSTNode]] = {}
        for node, rng in self.positions.items():
            if isinstance(node, _CALLISH):
                key = (rng.start.line, rng.start.column, rng.end.line, rng.end.column)
                index.setdefault(key, []).append(node)
        return index

    def functions(self) -> list[cst.FunctionDef]:
        """Every function definition of the file, outer ones before those nested in them."""
        found = [(rng.start.line, rng.start.column, node) for node, rng in self.positions.items()
                 if isinstance(node, cst.FunctionDef)]
        return [node for _, _, node in sorted(found, key=lambda f: f[:2])]

    @cached_property
    def _unpacked(self) -> dict[tuple[int, int, int, int], cst.BaseExpression]:
        """The value of each `a, b, c = value`, by the range of its target."""
        out = {}
        for node, rng in self.positions.items():
            if isinstance(node, (cst.Tuple, cst.List)) and isinstance(self.parents.get(node), cst.AssignTarget):
                assign = self.parents.get(self.parents[node])
                if isinstance(assign, cst.Assign) and len(assign.targets) == 1:
                    out[(rng.start.line, rng.start.column, rng.end.line, rng.end.column)] = assign.value
        return out

    def unpacked_value(self, line: int, col: int, end_line: int, end_col: int) -> cst.BaseExpression | None:
        """`value` when the range is the target of `a, b, c = value`: a traced op there (the
        Tensor.unbind that unpacking a tensor runs) reads what `value` gives."""
        return self._unpacked.get((line, col, end_line, end_col))

    def span_of(self, node: cst.CSTNode) -> Span:
        rng = self.positions[node]
        return Span(str(self.path), rng.start.line, rng.start.column, rng.end.line, rng.end.column)

    def char_col(self, line: int, byte_col: int) -> int:
        """Convert a UTF-8 byte offset within a line (what co_positions gives) to characters."""
        if line < 1 or line > len(self.lines):
            return byte_col
        return len(self.lines[line - 1].encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))

    def node_at(self, line: int, col: int, end_line: int, end_col: int) -> cst.CSTNode | None:
        """The expression node a bytecode position range refers to.

        An exact match wins; otherwise the smallest call-like node containing the range and ending
        where it ends (multi-line method chains start the range at `.meth`, not at the receiver).
        """
        exact = self._index.get((line, col, end_line, end_col))
        if exact:
            return min(exact, key=lambda n: isinstance(n, cst.Attribute))
        best, best_start = None, None
        for (l0, c0, l1, c1), nodes in self._index.items():
            if (l1, c1) != (end_line, end_col) or (l0, c0) > (line, col):
                continue
            for node in nodes:
                if not isinstance(node, cst.Attribute) and (best_start is None or (l0, c0) > best_start):
                    best, best_start = node, (l0, c0)
        return best


@lru_cache(maxsize=4096)
def resolved(path: str) -> str:
    """`str(Path(path).resolve())`, once per spelling: the trace asks for the file of every
    traced call, and resolving is a system call per path component."""
    return str(Path(path).resolve())


class SourceSet:
    """Every source file the tool reads, parsed once."""

    def __init__(self) -> None:
        self._files: dict[str, SourceFile] = {}

    def get(self, path: str | Path) -> SourceFile:
        key = resolved(str(path))
        if key not in self._files:
            self._files[key] = SourceFile.parse(Path(key))
        return self._files[key]

    def __contains__(self, path: str) -> bool:
        return resolved(str(path)) in self._files

    def files(self) -> list[SourceFile]:
        return list(self._files.values())
