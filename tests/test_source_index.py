"""Spec of the source index: a code position, as Python reports it, finds its LibCST node.

Positions come from Python itself (`compile()` + `co_positions()` of the real bytecode, or the
real tracer running a real model file); expected nodes are located by searching the snippet's
text, never by asking the index. Nothing is mocked.
"""
from __future__ import annotations

import dis
import textwrap
from pathlib import Path

import libcst as cst
import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.source.files import SourceFile, Span


# ---- helpers ---------------------------------------------------------------------------------
def write(tmp_path: Path, text: str, name: str = "snippet.py") -> SourceFile:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return SourceFile.parse(path)


def char_span(source: SourceFile, needle: str, occurrence: int = 0) -> tuple[int, int, int, int]:
    """(line, col, end_line, end_col) of the n-th occurrence of `needle`, in characters."""
    start = -1
    for _ in range(occurrence + 1):
        start = source.text.index(needle, start + 1)
    end = start + len(needle)

    def line_col(offset: int) -> tuple[int, int]:
        before = source.text[:offset]
        return before.count("\n") + 1, offset - (before.rfind("\n") + 1)

    return (*line_col(start), *line_col(end))


def text_of(source: SourceFile, node: cst.CSTNode) -> str:
    """The exact source text a node's position covers (LibCST positions exclude parentheses)."""
    span = source.span_of(node)
    lines = source.text.splitlines(keepends=True)
    if span.line == span.end_line:
        return lines[span.line - 1][span.col:span.end_col]
    return "".join([lines[span.line - 1][span.col:], *lines[span.line:span.end_line - 1],
                    lines[span.end_line - 1][:span.end_col]])


def bytecode_positions(source: SourceFile, opname: str, argrepr: str | None = None) -> list[dis.Positions]:
    """Positions Python's compiler gives to the `opname` instructions of the file (all functions)."""
    found, todo = [], [compile(source.text, str(source.path), "exec")]
    while todo:
        code = todo.pop()
        todo += [c for c in code.co_consts if hasattr(c, "co_positions")]
        found += [ins.positions for ins in dis.get_instructions(code)
                  if ins.opname == opname and (argrepr is None or ins.argrepr == argrepr)]
    return sorted(found, key=lambda p: (p.lineno, p.col_offset))


def node_at_bytecode(source: SourceFile, pos: dis.Positions) -> cst.CSTNode | None:
    """What the tracer does with a frame position: byte columns to characters, then node_at."""
    return source.node_at(pos.lineno, source.char_col(pos.lineno, pos.col_offset), pos.end_lineno,
                          source.char_col(pos.end_lineno, pos.end_col_offset))


# ---- exact spans -----------------------------------------------------------------------------
def test_exact_span_of_a_call_gives_that_call(tmp_path):
    source = write(tmp_path, """
        y = torch.relu(x) + torch.tanh(x)
    """)
    node = source.node_at(*char_span(source, "torch.tanh(x)"))
    assert isinstance(node, cst.Call)
    assert text_of(source, node) == "torch.tanh(x)"


def test_exact_span_of_a_whole_expression_gives_the_outer_node_not_a_part(tmp_path):
    source = write(tmp_path, """
        y = torch.relu(x) + torch.tanh(x)
    """)
    node = source.node_at(*char_span(source, "torch.relu(x) + torch.tanh(x)"))
    assert isinstance(node, cst.BinaryOperation)


def test_a_range_that_ends_inside_no_expression_maps_to_nothing(tmp_path):
    source = write(tmp_path, """
        y = torch.relu(x) + 1
    """)
    line, col, end_line, _ = char_span(source, "torch.relu(x)")
    assert source.node_at(line, col, end_line, col + 5) is None     # `torch` ends no call-like node


def test_every_call_in_a_real_transformers_file_is_found_by_its_own_position():
    import transformers.models.gpt2.modeling_gpt2 as gpt2

    source = SourceFile.parse(Path(gpt2.__file__))
    calls = [node for node in source.positions if isinstance(node, (cst.Call, cst.Subscript, cst.BinaryOperation))]
    assert len(calls) > 300
    lost = [text_of(source, n) for n in calls if source.node_at(*_tuple(source.span_of(n))) is not n]
    assert lost == []


def _tuple(span: Span) -> tuple[int, int, int, int]:
    return span.line, span.col, span.end_line, span.end_col


# ---- multi-line method chains -------------------------------------------------------------------
CHAIN = """
    def f(x):
        return (x
                .view(4, 4)
                .sum(0))
"""


def test_python_starts_a_multiline_method_call_at_the_method_not_the_receiver(tmp_path):
    # The premise node_at is built on, checked against this interpreter's compiler.
    source = write(tmp_path, CHAIN)
    view_line, view_col, _, _ = char_span(source, ".view")
    calls = bytecode_positions(source, "CALL")
    view_call = next(p for p in calls if p.lineno == view_line)
    assert view_call.col_offset in (view_col, view_col + 1)     # at `.view` or at `view`
    assert (view_call.end_lineno, view_call.end_col_offset) == char_span(source, ".view(4, 4)")[2:]


def test_a_multiline_method_position_maps_to_the_call_including_its_receiver(tmp_path):
    source = write(tmp_path, CHAIN)
    view_line = char_span(source, ".view")[0]
    view_call = next(p for p in bytecode_positions(source, "CALL") if p.lineno == view_line)
    node = node_at_bytecode(source, view_call)
    assert isinstance(node, cst.Call) and node.func.attr.value == "view"
    assert text_of(source, node) == "x\n            .view(4, 4)"


def test_the_last_method_of_a_multiline_chain_maps_to_the_whole_chain(tmp_path):
    source = write(tmp_path, CHAIN)
    sum_line = char_span(source, ".sum")[0]
    sum_call = next(p for p in bytecode_positions(source, "CALL") if p.lineno == sum_line)
    node = node_at_bytecode(source, sum_call)
    assert isinstance(node, cst.Call) and node.func.attr.value == "sum"
    assert text_of(source, node).startswith("x\n") and text_of(source, node).endswith(".sum(0)")


def test_a_multiline_method_inside_a_larger_expression_maps_to_the_call_not_the_expression(tmp_path):
    # `w + x.view(...)` ends where the view call ends: the smaller node is the one called.
    source = write(tmp_path, """
        def g(x, w):
            return torch.relu(w + x
                              .view(4, 4))
    """)
    view_line = char_span(source, ".view")[0]
    view_call = next(p for p in bytecode_positions(source, "CALL") if p.lineno == view_line)
    node = node_at_bytecode(source, view_call)
    assert isinstance(node, cst.Call) and text_of(source, node).startswith("x\n")


# ---- unicode before a call on the same line ------------------------------------------------------
UNICODE = """
    def f(x):
        größe = x.shape[-1]; ñ = torch.relu(x) * größe
        label = "→ é"; return ñ.view(-1)
"""


def test_python_positions_count_utf8_bytes_not_characters(tmp_path):
    source = write(tmp_path, UNICODE)
    line, col, _, end_col = char_span(source, "torch.relu(x)")
    relu = next(p for p in bytecode_positions(source, "CALL") if p.lineno == line and p.col_offset > 20)
    prefix = source.text.splitlines()[line - 1][:col]
    assert relu.col_offset == len(prefix.encode("utf-8")) != col


def test_char_col_converts_byte_offsets_to_characters(tmp_path):
    source = write(tmp_path, UNICODE)
    line, col, _, end_col = char_span(source, "torch.relu(x)")
    relu = next(p for p in bytecode_positions(source, "CALL") if p.lineno == line and p.col_offset > 20)
    assert (source.char_col(line, relu.col_offset), source.char_col(line, relu.end_col_offset)) == (col, end_col)


@pytest.mark.parametrize("needle", ["torch.relu(x)", "ñ.view(-1)"])
def test_a_call_after_unicode_text_maps_to_that_call(tmp_path, needle):
    source = write(tmp_path, UNICODE)
    line = char_span(source, needle)[0]
    method = needle.split("(")[0].split(".")[-1]
    candidates = [node_at_bytecode(source, p) for p in bytecode_positions(source, "CALL") if p.lineno == line]
    assert needle in [text_of(source, n) for n in candidates if n is not None and
                      isinstance(n, cst.Call) and n.func.attr.value == method]


# ---- operators and subscripts -------------------------------------------------------------------
OPERATORS = """
    def f(x, a):
        y = x[:, 0] + -x[..., None][0]
        y += 1
        m = (y == 0)
        z = (a * y) @ m
        return z.T
"""


@pytest.mark.parametrize("opname, argrepr, expected", [
    ("BINARY_OP", "+", "x[:, 0] + -x[..., None][0]"),
    ("BINARY_OP", "*", "a * y"),
    ("BINARY_OP", "@", "(a * y) @ m"),
    ("BINARY_OP", "+=", "y += 1"),
    ("UNARY_NEGATIVE", None, "-x[..., None][0]"),
    ("COMPARE_OP", "==", "y == 0"),
    ("LOAD_ATTR", "T", "z.T"),
])
def test_operator_positions_map_to_the_operator_expression(tmp_path, opname, argrepr, expected):
    source = write(tmp_path, OPERATORS)
    [pos] = bytecode_positions(source, opname, argrepr)
    node = node_at_bytecode(source, pos)
    assert node is not None and text_of(source, node) == expected


def test_parenthesized_operands_map_to_the_operation_inside_the_parentheses(tmp_path):
    source = write(tmp_path, OPERATORS)
    [mul] = bytecode_positions(source, "BINARY_OP", "*")
    node = node_at_bytecode(source, mul)
    assert isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply)
    assert node.lpar, "the node found is the parenthesized `(a * y)` itself"


@pytest.mark.parametrize("expected", ["x[:, 0]", "x[..., None]", "x[..., None][0]"])
def test_subscript_positions_map_to_subscripts(tmp_path, expected):
    source = write(tmp_path, OPERATORS)
    nodes = [node_at_bytecode(source, p) for p in bytecode_positions(source, "BINARY_SUBSCR")]
    assert all(isinstance(n, cst.Subscript) for n in nodes)
    assert expected in [text_of(source, n) for n in nodes]


# ---- the same, through the real tracer on a real model file ---------------------------------------
MODEL = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        größe = x.shape[-1]; ñ = torch.relu(x) * größe
        h = (self.proj(ñ)
             .view(4, 2, 4)
             .transpose(0, 1))
        label = "→ é"; flat = h.reshape(2, 16)
        y = flat[:, 0] + -flat[..., 1]
        y += 1
        m = (y * 2) == 0
        return (y @ y) + m.float().mean() + flat.T.sum()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)
'''


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "unicode_model.py"
    path.write_text(MODEL.lstrip("\n"), encoding="utf-8")
    analysis = analyze(path)
    return analysis, analysis.sources.get(path)


def _sites(analysis, callee):
    return [site for (span, name), site in analysis.graph.sites.items() if name == callee]


@pytest.mark.parametrize("callee, needle", [
    ("torch.relu", "torch.relu(x)"),                  # after unicode identifiers
    ("Tensor.mul", "torch.relu(x) * größe"),
    ("torch.nn.Linear", "self.proj(ñ)"),
    ("Tensor.reshape", "h.reshape(2, 16)"),            # after a unicode string literal
    ("Tensor.__getitem__", "flat[:, 0]"),
    ("Tensor.__getitem__", "flat[..., 1]"),
    ("Tensor.neg", "-flat[..., 1]"),
    ("Tensor.add", "flat[:, 0] + -flat[..., 1]"),
    ("Tensor.__eq__", "(y * 2) == 0"),
    ("Tensor.matmul", "y @ y"),
    ("Tensor.T", "flat.T"),
])
def test_tracer_attributes_each_torch_call_to_its_exact_span(traced, callee, needle):
    analysis, source = traced
    spans = [site.span for site in _sites(analysis, callee)]
    line, col, end_line, end_col = char_span(source, needle)
    assert Span(str(source.path), line, col, end_line, end_col) in spans


def test_tracer_attributes_an_in_place_operator_to_the_augmented_assignment(traced):
    analysis, source = traced
    nodes = [source.node_at(*_tuple(site.span)) for site in _sites(analysis, "Tensor.add_")
             + _sites(analysis, "Tensor.__iadd__")]
    assert [text_of(source, n) for n in nodes] == ["y += 1"]


@pytest.mark.parametrize("callee, method", [("Tensor.view", "view"), ("Tensor.transpose", "transpose")])
def test_tracer_attributes_a_multiline_chained_method_to_its_call(traced, callee, method):
    analysis, source = traced
    [site] = _sites(analysis, callee)
    node = source.node_at(*_tuple(site.span))
    assert isinstance(node, cst.Call) and node.func.attr.value == method
    assert text_of(source, node).startswith("self.proj(ñ)\n")
    # the span is the whole call's, receiver included, so the rewrite finds the node it names
    # (the bytecode range starts at `.view(`, a position no CST node starts at)
    assert site.span == source.span_of(node)


def test_tracer_maps_every_op_of_the_snippet(traced):
    analysis, _ = traced
    summary = analysis.graph.summary()
    assert summary["compute_ops"] > 0 and summary["mapped"] == summary["compute_ops"]
