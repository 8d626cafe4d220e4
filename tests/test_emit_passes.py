"""Golden before/after specs of the LibCST rewrite passes, one behaviour per test.

Each test writes a small model source to a file, parses it with the tool's own SourceFile,
builds by hand the edit that a plan would produce (Edits / SiteEdit / CtorEdit / SizeEdit,
keyed by the span of the node it targets), runs the real `rewrite_module` traversal and
compares the resulting source with what a reviewer wants to read. No mocks: real LibCST
round trips, and the import passes run on transformers' real modeling files.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import textwrap
from pathlib import Path

import libcst as cst
import pytest

from nnscaler_cst.emit.assemble import (AbsoluteImports, DropImportedNames, add_comm_import, read_header,
                                        with_header)
from nnscaler_cst.emit.rewrite import InsertCollectives, LocalSizes, ShardConstructors, rewrite_module
from nnscaler_cst.errors import UserError
from nnscaler_cst.materialize.conversions import Step
from nnscaler_cst.materialize.edits import CtorEdit, Edits, SiteEdit, SizeEdit
from nnscaler_cst.source.files import SourceFile, Span

COPY_NOTE = "tp_copy: fwd: identity, bwd: all-reduce"
REDUCE_NOTE = "tp_reduce: fwd: all-reduce, bwd: identity"
GATHER_NOTE = "tp_gather: fwd: all-gather, bwd: keep own slice"
SCATTER_NOTE = "tp_scatter: fwd: keep own slice, bwd: all-gather"


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def parse(tmp_path: Path, source: str) -> SourceFile:
    path = tmp_path / "model.py"
    path.write_text(dedent(source), encoding="utf-8")
    return SourceFile.parse(path)


def span(source: SourceFile, text: str) -> Span:
    """The span of the one call / binary operation / subscript whose source is exactly `text`."""
    found = [source.span_of(node) for node in source.positions
             if isinstance(node, (cst.Call, cst.BinaryOperation, cst.Subscript))
             and cst.Module([]).code_for_node(node) == text]
    assert len(found) == 1, f"expected one node `{text}`, found {len(found)}"
    return found[0]


def span_in(source: SourceFile, statement: str, text: str) -> Span:
    """The span of the node `text` inside the one statement line whose source is `statement`."""
    lines = [source.span_of(node) for node in source.positions if isinstance(node, cst.SimpleStatementLine)
             and cst.Module([]).code_for_node(node).strip() == statement]
    assert len(lines) == 1, f"expected one statement `{statement}`, found {len(lines)}"
    found = [source.span_of(node) for node in source.positions
             if isinstance(node, (cst.Call, cst.BinaryOperation, cst.Subscript))
             and cst.Module([]).code_for_node(node) == text and lines[0].contains(source.span_of(node))]
    assert len(found) == 1, f"expected one node `{text}` in `{statement}`, found {len(found)}"
    return found[0]


def no_edits(n: int = 2) -> Edits:
    return Edits("tp", n, sites={}, ctors={}, param_layout={}, partial_grad_params=[])


def rewritten(source: SourceFile, edits: Edits):
    module, ctx = rewrite_module(source, edits)
    return module.code, ctx


def test_every_concern_describes_itself():
    for concern in (ShardConstructors, LocalSizes, InsertCollectives, AbsoluteImports, DropImportedNames):
        assert concern.DESCRIPTION.strip(), concern.__name__


def test_no_edits_gives_the_file_back_byte_for_byte(tmp_path):
    text = """
        import torch.nn as nn


        class Block(nn.Module):  # the user's comment
            def forward(self, x):
                return self.fc(x)   # odd  spacing  kept
    """
    source = parse(tmp_path, text)
    code, ctx = rewritten(source, no_edits())
    assert code == dedent(text)
    assert ctx.used == set() and not ctx.needs_torch


# --------------------------------------------------------------------------------------------
# ShardConstructors: divide the constructor argument that sizes a split parameter
# --------------------------------------------------------------------------------------------

CTOR_SOURCE = """
    import torch
    import torch.nn as nn


    class Attention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            self.up = nn.Linear(in_features=config.n_embd, out_features=config.hidden)
            self.down = nn.Linear(config.hidden + config.extra, config.n_embd)
            self.scale = nn.Parameter(torch.ones(config.n_embd))
            self.wrapped = nn.Linear(**config.kwargs)
"""


def test_positional_out_features_keeps_the_users_expression_divided(tmp_path):
    source = parse(tmp_path, CTOR_SOURCE)
    edits = no_edits()
    edits.ctors[span(source, "nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)")] = [
        CtorEdit(["arg1", "out_features"], 2, "out_features / 2, 3 fused blocks split alike")]
    code, _ = rewritten(source, edits)
    assert "        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd // 2, bias=config.bias)" \
           "  # out_features / 2, 3 fused blocks split alike\n" in code
    # nothing else changed
    assert code.replace(" // 2, bias", ", bias").replace(
        "  # out_features / 2, 3 fused blocks split alike", "") == dedent(CTOR_SOURCE)


def test_keyword_out_features_is_divided_where_it_is_written(tmp_path):
    source = parse(tmp_path, CTOR_SOURCE)
    edits = no_edits()
    edits.ctors[span(source, "nn.Linear(in_features=config.n_embd, out_features=config.hidden)")] = [
        CtorEdit(["arg1", "out_features"], 2, "out_features / 2")]
    code, _ = rewritten(source, edits)
    assert ("        self.up = nn.Linear(in_features=config.n_embd, out_features=config.hidden // 2)"
            "  # out_features / 2\n") in code


def test_a_sum_is_parenthesized_before_it_is_divided(tmp_path):
    source = parse(tmp_path, CTOR_SOURCE)
    edits = no_edits()
    edits.ctors[span(source, "nn.Linear(config.hidden + config.extra, config.n_embd)")] = [
        CtorEdit(["arg0", "in_features"], 2, "in_features / 2")]
    code, _ = rewritten(source, edits)
    assert ("        self.down = nn.Linear((config.hidden + config.extra) // 2, config.n_embd)"
            "  # in_features / 2\n") in code


def test_a_parameter_factory_call_has_its_size_divided(tmp_path):
    source = parse(tmp_path, CTOR_SOURCE)
    edits = no_edits(4)
    edits.ctors[span(source, "nn.Parameter(torch.ones(config.n_embd))")] = [
        CtorEdit(["factory:0"], 4, "* / 4")]
    code, _ = rewritten(source, edits)
    assert "        self.scale = nn.Parameter(torch.ones(config.n_embd // 4))  # * / 4\n" in code


def test_a_factory_inside_arithmetic_has_its_size_divided(tmp_path):
    source = parse(tmp_path, """
        class Layer(nn.Module):
            def __init__(self, config):
                self.lambda_1 = nn.Parameter(config.init_values * torch.ones(config.hidden_size), requires_grad=True)
    """)
    edits = no_edits()
    edits.ctors[span(source, "nn.Parameter(config.init_values * torch.ones(config.hidden_size), requires_grad=True)")] \
        = [CtorEdit(["factory:0"], 2, "* / 2")]
    code, _ = rewritten(source, edits)
    assert ("        self.lambda_1 = nn.Parameter(config.init_values * torch.ones(config.hidden_size // 2), "
            "requires_grad=True)  # * / 2\n") in code


@pytest.mark.parametrize("written, dim, rank, local", [
    ("init_values * torch.ones(config.hidden_size)", 0, 1, "init_values * torch.ones(config.hidden_size // 2)"),
    ("torch.ones(dim) * init_values", 0, 1, "torch.ones(dim // 2) * init_values"),
    ("torch.full((self.dim,), 0.1)", 0, 1, "torch.full((self.dim // 2,), 0.1)"),
    ("torch.full(size=[dim], fill_value=0.1)", 0, 1, "torch.full(size=[dim // 2], fill_value=0.1)"),
    ("torch.zeros(config.dim)", 0, 1, "torch.zeros(config.dim // 2)"),
    ("torch.randn(a, b) * scale", 1, 2, "torch.randn(a, b // 2) * scale"),
    ("torch.randn((a, b)) * scale", 0, 2, "torch.randn((a // 2, b)) * scale"),
    ("torch.ones(size=(config.n,)) + 1.0", 0, 1, "torch.ones(size=(config.n // 2,)) + 1.0"),
    ("-torch.ones(n, dtype=torch.float32)", 0, 1, "-torch.ones(n // 2, dtype=torch.float32)"),
    ("torch.empty(n).uniform_(-0.5, 0.5)", 0, 1, "torch.empty(n // 2).uniform_(-0.5, 0.5)"),
    ("torch.Tensor(out_features, in_features)", 0, 2, "torch.Tensor(out_features // 2, in_features)"),
    ("nn.init.trunc_normal_(torch.zeros(1, 1, n), std=0.02)", 2, 3,
     "nn.init.trunc_normal_(torch.zeros(1, 1, n // 2), std=0.02)"),
])
def test_the_size_of_a_parameter_factory_is_found_through_common_forms(tmp_path, written, dim, rank, local):
    """Layer scales and learned tokens: `scale * torch.ones(n)`, `torch.full((n,), v)`, `torch.randn(a, b)
    * s`, ...: the factory's size argument for the split dim is divided, the rest kept as written."""
    source = parse(tmp_path, f"""
        class Layer(nn.Module):
            def __init__(self, config):
                self.gamma = nn.Parameter({written}, requires_grad=True)
    """)
    edits = no_edits()
    edits.ctors[span(source, f"nn.Parameter({written}, requires_grad=True)")] = [
        CtorEdit([f"factory:{dim}"], 2, f"dim {dim} / 2", rank)]
    code, _ = rewritten(source, edits)
    assert f"        self.gamma = nn.Parameter({local}, requires_grad=True)  # dim {dim} / 2\n" in code


@pytest.mark.parametrize("written, shapes, why", [
    ("torch.ones(shape) * 0.5", {"shape"}, "a whole shape"),
    ("torch.full(shape, 0.5)", set(), "a whole shape"),
    ("torch.ones(*shape)", set(), "inside *args"),
    ("torch.ones(n) * torch.rand(n)", set(), "more than one factory"),
    ("weights.clone()", set(), "calls no tensor factory"),
    ("torch.Tensor([0.5])", set(), "holds values"),
    ("torch.ones(a, b)", set(), "cannot tell which size"),        # a 1-dim parameter from two sizes
])
def test_a_factory_size_that_cannot_be_found_says_why(written, shapes, why):
    from nnscaler_cst.materialize.size_args import factory_size
    call = cst.parse_expression(f"nn.Parameter({written})")
    found = factory_size(call, 0, 1, frozenset(shapes))
    assert isinstance(found, str) and why in found, found


def test_a_constructor_that_does_not_pass_the_size_is_refused_at_its_call(tmp_path):
    source = parse(tmp_path, CTOR_SOURCE)
    edits = no_edits()
    site = span(source, "nn.Linear(**config.kwargs)")
    edits.ctors[site] = [CtorEdit(["arg1", "out_features"], 2, "out_features / 2")]
    with pytest.raises(UserError) as info:
        rewritten(source, edits)
    assert "out_features" in info.value.message
    assert (info.value.location.line, info.value.location.col) == (site.line, site.col)


# --------------------------------------------------------------------------------------------
# LocalSizes: size arguments of views and splits of a split tensor become local
# --------------------------------------------------------------------------------------------

SIZES_SOURCE = """
    class Attention(nn.Module):
        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            y = x.view(B, T, C)  # re-assemble all head outputs
            z = x.reshape((B, T, C))
            a, b = x.split([self.d_a, self.d_b], dim=-1)
            shape = (B, T, C)
            w = x.view(shape)
            return y
"""


def test_view_size_of_the_split_dim_is_divided(tmp_path):
    source = parse(tmp_path, SIZES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "x.view(B, T, C)")).sizes.append(SizeEdit(("pos", 2), None, 2, "dim 2 / 2"))
    code, _ = rewritten(source, edits)
    assert "        y = x.view(B, T, C // 2)  # re-assemble all head outputs | local size: C / 2\n" in code


def test_split_size_is_divided_and_keeps_dim_keyword(tmp_path):
    source = parse(tmp_path, SIZES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "self.c_attn(x).split(self.n_embd, dim=2)")).sizes.append(
        SizeEdit(("pos", 0), None, 2, "pieces / 2"))
    code, _ = rewritten(source, edits)
    assert "        q, k, v = self.c_attn(x).split(self.n_embd // 2, dim=2)  # local size: self.n_embd / 2\n" in code


def test_one_item_of_a_tuple_literal_is_divided(tmp_path):
    source = parse(tmp_path, SIZES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "x.reshape((B, T, C))")).sizes.append(SizeEdit(("pos", 0), 2, 2, "dim 2 / 2"))
    code, _ = rewritten(source, edits)
    assert "        z = x.reshape((B, T, C // 2))  # local size: C / 2\n" in code


def test_every_section_of_a_split_list_is_divided(tmp_path):
    source = parse(tmp_path, SIZES_SOURCE)
    edits = no_edits()
    site = edits.site(span(source, "x.split([self.d_a, self.d_b], dim=-1)"))
    site.sizes += [SizeEdit(("pos", 0), 0, 2, "pieces / 2"), SizeEdit(("pos", 0), 1, 2, "pieces / 2")]
    code, _ = rewritten(source, edits)
    assert ("        a, b = x.split([self.d_a // 2, self.d_b // 2], dim=-1)"
            "  # local size: self.d_a / 2; local size: self.d_b / 2\n") in code


def test_a_size_that_comes_from_a_variable_is_refused(tmp_path):
    source = parse(tmp_path, SIZES_SOURCE)
    edits = no_edits()
    site = span(source, "x.view(shape)")
    edits.site(site).sizes.append(SizeEdit(("pos", 0), 2, 2, "dim 2 / 2"))
    with pytest.raises(UserError) as info:
        rewritten(source, edits)
    assert "`shape`" in info.value.message
    assert (info.value.location.line, info.value.location.col) == (site.line, site.col)
    assert info.value.hint


# --------------------------------------------------------------------------------------------
# InsertCollectives: named collectives around arguments and results; split implementations
# --------------------------------------------------------------------------------------------

COLLECTIVES_SOURCE = """
    import torch.nn.functional as F


    class MLP(nn.Module):
        def forward(self, x, pos):
            h = self.c_fc(x)
            h = self.act(h)  # activation
            y = self.c_proj(h)
            o = self.o_proj(h).view(B, T, C)
            z = self.proj(h).view(B, T, C)
            w = h + pos
            u = F.linear(h, self.w, self.b)
            e = F.embedding(x, self.wte)
            last = h[..., -1]
            return y
"""


def test_an_argument_is_wrapped_in_tp_copy(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "self.c_fc(x)")).args[("pos", 0)] = [Step("copy")]
    code, ctx = rewritten(source, edits)
    assert f"        h = self.c_fc(tp_copy(x, TP))  # {COPY_NOTE}\n" in code
    assert ctx.used == {"tp_copy", "TP"}


def test_a_result_is_wrapped_in_tp_reduce(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "self.c_proj(h)")).result.append(Step("reduce"))
    code, ctx = rewritten(source, edits)
    assert f"        y = tp_reduce(self.c_proj(h), TP)  # {REDUCE_NOTE}\n" in code
    assert ctx.used == {"tp_reduce", "TP"}


def row_parallel(template: str, bias: str) -> SiteEdit:
    """A row-parallel site: the call without its bias, reduced, then the bias added once."""
    return SiteEdit(result=[Step("reduce")], replace=template, bias=bias,
                    notes=["partial sums reduced, bias added once"])


def test_row_parallel_linear_adds_its_bias_once_after_the_reduction(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.sites[span(source, "self.c_proj(h)")] = row_parallel(
        "torch.nn.functional.linear({arg0}, {self}.weight)", "self.bias")
    code, ctx = rewritten(source, edits)
    assert ("        y = tp_reduce(torch.nn.functional.linear(h, self.c_proj.weight), TP) + self.c_proj.bias"
            f"  # partial sums reduced, bias added once; {REDUCE_NOTE}\n") in code
    assert ctx.needs_torch          # the template calls torch.nn.functional: `import torch` is needed
    assert ctx.used == {"tp_reduce", "TP"}


def test_row_parallel_functional_linear_takes_its_bias_from_the_call(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.sites[span(source, "F.linear(h, self.w, self.b)")] = row_parallel(
        "torch.nn.functional.linear({arg0}, {arg1})", "arg2")
    code, _ = rewritten(source, edits)
    assert ("        u = tp_reduce(torch.nn.functional.linear(h, self.w), TP) + self.b"
            f"  # partial sums reduced, bias added once; {REDUCE_NOTE}\n") in code


def test_row_parallel_result_used_by_a_method_keeps_the_sum_in_parentheses(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.sites[span(source, "self.o_proj(h)")] = row_parallel(
        "torch.nn.functional.linear({arg0}, {self}.weight)", "self.bias")
    code, _ = rewritten(source, edits)
    assert ("        o = (tp_reduce(torch.nn.functional.linear(h, self.o_proj.weight), TP) + self.o_proj.bias)"
            ".view(B, T, C)") in code


PRECEDENCE_SOURCE = """
    def forward(self, x, h):
        a = self.p(h) * self.scale
        b = -self.p(h)
        c = self.p(h)[0]
        d = x - self.p(h)
        e = self.p(h) + x
"""


@pytest.mark.parametrize("statement, expected", [
    ("a = self.p(h) * self.scale", "a = (REDUCED + self.p.bias) * self.scale"),
    ("b = -self.p(h)", "b = -(REDUCED + self.p.bias)"),
    ("c = self.p(h)[0]", "c = (REDUCED + self.p.bias)[0]"),
    ("d = x - self.p(h)", "d = x - (REDUCED + self.p.bias)"),
])
def test_row_parallel_bias_sum_keeps_the_users_operator_precedence(tmp_path, statement, expected):
    source = parse(tmp_path, PRECEDENCE_SOURCE)
    edits = no_edits()
    edits.sites[span_in(source, statement, "self.p(h)")] = row_parallel(
        "torch.nn.functional.linear({arg0}, {self}.weight)", "self.bias")
    code, _ = rewritten(source, edits)
    reduced = "tp_reduce(torch.nn.functional.linear(h, self.p.weight), TP)"
    line = next(line.strip() for line in code.splitlines() if line.strip().startswith(statement[:4]))
    assert line.split("  #")[0] == expected.replace("REDUCED", reduced)


def test_row_parallel_bias_sum_needs_no_parentheses_as_the_left_operand_of_a_sum(tmp_path):
    source = parse(tmp_path, PRECEDENCE_SOURCE)
    edits = no_edits()
    edits.sites[span_in(source, "e = self.p(h) + x", "self.p(h)")] = row_parallel(
        "torch.nn.functional.linear({arg0}, {self}.weight)", "self.bias")
    code, _ = rewritten(source, edits)
    assert ("    e = tp_reduce(torch.nn.functional.linear(h, self.p.weight), TP) + self.p.bias + x"
            f"  # partial sums reduced, bias added once; {REDUCE_NOTE}\n") in code


def test_a_method_receiver_is_gathered_before_the_method_runs(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "self.proj(h).view(B, T, C)")).args[("self",)] = [Step("gather", 1)]
    code, ctx = rewritten(source, edits)
    assert f"        z = tp_gather(self.proj(h), TP, dim=1).view(B, T, C)  # {GATHER_NOTE}\n" in code
    assert ctx.used == {"tp_gather", "TP"}


def test_the_right_operand_of_a_binary_operation_is_scattered(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "h + pos")).args[("pos", 0)] = [Step("scatter", -1)]
    code, _ = rewritten(source, edits)
    assert f"        w = h + tp_scatter(pos, TP, dim=-1)  # {SCATTER_NOTE}\n" in code


def test_the_left_operand_of_a_binary_operation_is_gathered_with_its_fused_groups(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "h + pos")).args[("self",)] = [Step("gather", 2, 3)]
    code, _ = rewritten(source, edits)
    assert f"        w = tp_gather(h, TP, dim=2, groups=3) + pos  # {GATHER_NOTE}\n" in code


def test_an_indexed_value_is_gathered_before_indexing(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "h[..., -1]")).args[("self",)] = [Step("gather", -1)]
    code, _ = rewritten(source, edits)
    assert f"        last = tp_gather(h, TP, dim=-1)[..., -1]  # {GATHER_NOTE}\n" in code


WRITES_SOURCE = """
class M(nn.Module):
    def forward(self, x, v):
        if x.dim() == 3:
            x[..., :4] = v  # reserved units
        return x
"""


def test_a_tensor_written_by_index_is_converted_and_rebound_on_a_line_before_the_write(tmp_path):
    source = parse(tmp_path, WRITES_SOURCE)
    edits = no_edits()
    write = edits.site(span(source, "x[..., :4]"))
    write.writes, write.args[("self",)] = True, [Step("gather", -1)]
    code, ctx = rewritten(source, edits)
    assert (f"        if x.dim() == 3:\n"
            f"            x = tp_gather(x, TP, dim=-1)  # {GATHER_NOTE}\n"
            f"            x[..., :4] = v  # reserved units\n") in code
    assert ctx.used == {"tp_gather", "TP"}
    compile(code, "model.py", "exec")


def test_the_value_written_by_index_is_converted_where_it_is_assigned(tmp_path):
    source = parse(tmp_path, WRITES_SOURCE)
    edits = no_edits()
    write = edits.site(span(source, "x[..., :4]"))
    write.writes, write.args[("pos", 1)] = True, [Step("scatter", -1)]
    code, _ = rewritten(source, edits)
    assert f"            x[..., :4] = tp_scatter(v, TP, dim=-1)  # reserved units | {SCATTER_NOTE}\n" in code


def test_a_written_tensor_that_is_not_a_plain_name_is_refused(tmp_path):
    source = parse(tmp_path, WRITES_SOURCE.replace("x[..., :4] = v", "x.data[..., :4] = v"))
    edits = no_edits()
    write = edits.site(span(source, "x.data[..., :4]"))
    write.writes, write.args[("self",)] = True, [Step("gather", -1)]
    with pytest.raises(UserError, match="tensor written here") as info:
        rewritten(source, edits)
    assert info.value.location.line == 4


def test_a_split_implementation_replaces_the_call_and_is_imported_from_comm(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.sites[span(source, "F.embedding(x, self.wte)")] = SiteEdit(
        result=[Step("reduce")], replace="vocab_parallel_embedding({arg0}, {arg1}, TP)",
        notes=["split 2-way by vocab_parallel_embedding"])
    code, ctx = rewritten(source, edits)
    assert ("        e = tp_reduce(vocab_parallel_embedding(x, self.wte, TP), TP)"
            f"  # split 2-way by vocab_parallel_embedding; {REDUCE_NOTE}\n") in code
    assert ctx.used == {"vocab_parallel_embedding", "tp_reduce", "TP"}
    assert not ctx.needs_torch


def test_two_collectives_on_one_argument_nest_in_order(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "self.c_fc(x)")).args[("pos", 0)] = [Step("reduce"), Step("copy")]
    code, _ = rewritten(source, edits)
    assert f"        h = self.c_fc(tp_copy(tp_reduce(x, TP), TP))  # {REDUCE_NOTE}; {COPY_NOTE}\n" in code


def test_an_argument_that_is_not_written_in_the_call_is_refused(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    site = span(source, "self.c_fc(x)")
    edits.site(site).args[("pos", 3)] = [Step("copy")]
    with pytest.raises(UserError) as info:
        rewritten(source, edits)
    assert "copy" in info.value.message
    assert (info.value.location.line, info.value.location.col) == (site.line, site.col)


# --------------------------------------------------------------------------------------------
# Comments: the user's comment survives; the notes of every concern are appended once
# --------------------------------------------------------------------------------------------

def test_the_users_trailing_comment_is_kept_and_the_note_appended(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "self.act(h)")).result.append(Step("reduce"))
    code, _ = rewritten(source, edits)
    assert f"        h = tp_reduce(self.act(h), TP)  # activation | {REDUCE_NOTE}\n" in code


def test_concerns_on_one_statement_share_one_comment(tmp_path):
    source = parse(tmp_path, """
        class Net(nn.Module):
            def forward(self, x):
                return self.fc(x).view(B, T, C)
    """)
    edits = no_edits()
    edits.site(span(source, "self.fc(x)")).args[("pos", 0)] = [Step("copy")]
    edits.site(span(source, "self.fc(x).view(B, T, C)")).sizes.append(SizeEdit(("pos", 2), None, 2, "dim 2 / 2"))
    code, _ = rewritten(source, edits)
    assert code == dedent(f"""
        class Net(nn.Module):
            def forward(self, x):
                return self.fc(tp_copy(x, TP)).view(B, T, C // 2)  # {COPY_NOTE}; local size: C / 2
    """)


def test_one_edit_serves_every_statement_of_a_loop_body_once(tmp_path):
    """Edits are keyed by span: a site inside a loop is rewritten once, in place."""
    source = parse(tmp_path, """
        def forward(self, x):
            for block in self.blocks:
                x = block(x)  # every layer
            return x
    """)
    edits = no_edits()
    edits.site(span(source, "block(x)")).result.append(Step("reduce"))
    code, _ = rewritten(source, edits)
    assert code == dedent(f"""
        def forward(self, x):
            for block in self.blocks:
                x = tp_reduce(block(x), TP)  # every layer | {REDUCE_NOTE}
            return x
    """)


def test_the_rewritten_file_is_valid_python_that_compiles(tmp_path):
    source = parse(tmp_path, COLLECTIVES_SOURCE)
    edits = no_edits()
    edits.site(span(source, "self.c_fc(x)")).args[("pos", 0)] = [Step("copy")]
    edits.sites[span(source, "self.o_proj(h)")] = row_parallel(
        "torch.nn.functional.linear({arg0}, {self}.weight)", "self.bias")
    edits.site(span(source, "h + pos")).args[("self",)] = [Step("gather", -1)]
    code, _ = rewritten(source, edits)
    compile(code, "model.py", "exec")


# --------------------------------------------------------------------------------------------
# Assembly: imports made to work from the output folder, the _comm import, the header
# --------------------------------------------------------------------------------------------

def absolute(text: str, package: str) -> str:
    return cst.parse_module(dedent(text)).visit(AbsoluteImports(package)).code


def test_relative_imports_become_absolute_in_the_given_package():
    before = """
        import torch
        from torch import nn

        from ...activations import ACT2FN
        from ..gpt2.configuration_gpt2 import GPT2Config
        from .configuration_llama import LlamaConfig as Config
        from . import configuration_llama
    """
    assert absolute(before, "transformers.models.llama") == dedent("""
        import torch
        from torch import nn

        from transformers.activations import ACT2FN
        from transformers.models.gpt2.configuration_gpt2 import GPT2Config
        from transformers.models.llama.configuration_llama import LlamaConfig as Config
        from transformers.models.llama import configuration_llama
    """)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_absolute_imports_of_a_real_transformers_file_import(model):
    """Every name transformers' own modeling file imports relatively is importable absolutely."""
    spec = importlib.util.find_spec(f"transformers.models.{model}.modeling_{model}")
    text = Path(spec.origin).read_text(encoding="utf-8")
    assert "from ..." in text          # the file does use relative imports
    code = cst.parse_module(text).visit(AbsoluteImports(f"transformers.models.{model}")).code
    tree = ast.parse(code)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imports and all(n.level == 0 for n in imports)
    for node in imports:
        if not node.module.startswith("transformers"):
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            assert alias.name == "*" or hasattr(module, alias.name) or importlib.util.find_spec(
                f"{node.module}.{alias.name}"), f"from {node.module} import {alias.name}"


def test_imports_of_names_the_merged_file_defines_are_dropped():
    before = """
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers import LlamaForCausalLM
        from transformers.models.llama import LlamaModel as Base
        from helpers import *


        def build():
            return GPT2LMHeadModel(GPT2Config())
    """
    after = cst.parse_module(dedent(before)).visit(
        DropImportedNames({"GPT2LMHeadModel", "LlamaForCausalLM", "Base"})).code
    assert after == dedent("""
        import torch
        from transformers import GPT2Config
        from helpers import *


        def build():
            return GPT2LMHeadModel(GPT2Config())
    """)


def test_the_comm_import_goes_after_the_docstring_and_first_imports():
    before = dedent('''
        """Model."""
        import math

        import torch.nn as nn


        class Net(nn.Module):
            pass
    ''')
    after = add_comm_import(cst.parse_module(before), {"tp_reduce", "TP", "tp_copy"}, needs_torch=True).code
    assert after == dedent('''
        """Model."""
        import math

        import torch.nn as nn
        import torch
        from ._comm import TP, tp_copy, tp_reduce


        class Net(nn.Module):
            pass
    ''')


def test_nothing_is_imported_when_no_collective_is_used():
    before = "import torch\n\nx = 1\n"
    assert add_comm_import(cst.parse_module(before), set(), needs_torch=True).code == before


GENERATED_BODY = "import torch\n\n\nclass Net(torch.nn.Module):\n    pass\n"


def test_a_fresh_generated_file_reads_back_unedited():
    text = with_header(GENERATED_BODY, "from model.py; plan megatron tp=2 dp=1; rank 0 of 2")
    first, _, body = text.partition("\n")
    assert first.startswith("# @generated by nnscaler-rewrite ") and "plan megatron tp=2" in first
    assert body == GENERATED_BODY
    recorded, now = read_header(text)
    assert recorded == now


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("pass", "return None"),       # a change to the code
    lambda t: t + "# a note\n",                       # an added comment line
    lambda t: t.replace("    pass", "\tpass"),        # whitespace only
])
def test_a_hand_edit_anywhere_after_the_header_is_detected(edit):
    text = edit(with_header(GENERATED_BODY, "rank 0"))
    recorded, now = read_header(text)
    assert recorded != now


def test_a_file_without_the_generated_header_is_not_taken_for_a_generated_one():
    assert read_header(GENERATED_BODY) is None
    assert read_header("# @generated by someone else\n" + GENERATED_BODY) is None


AUGMENTED_SOURCE = """
class Embeddings(nn.Module):
    def forward(self, ids, positions):
        x = self.embed_tokens(ids) * self.embed_scale
        x += positions
        return self.norm(x)
"""


def test_the_result_of_an_augmented_assignment_is_converted_and_rebound_on_the_next_line(tmp_path):
    """FSMT's `x += positions` on a split embedding whose consumer needs it whole: `x += y` stays,
    and x is gathered on a line after it (it was refused: write `x = x + y` instead)."""
    source = parse(tmp_path, AUGMENTED_SOURCE)
    edits = no_edits()
    add = next(source.span_of(n) for n in source.positions if isinstance(n, cst.AugAssign))
    edits.site(add).result.append(Step("gather", 2))
    code, ctx = rewritten(source, edits)
    assert (f"        x += positions\n"
            f"        x = tp_gather(x, TP, dim=2)  # {GATHER_NOTE}\n"
            f"        return self.norm(x)\n") in code
    assert ctx.used == {"tp_gather", "TP"}
    compile(code, "model.py", "exec")


def test_the_result_of_an_augmented_assignment_to_an_attribute_is_still_refused(tmp_path):
    source = parse(tmp_path, AUGMENTED_SOURCE.replace("x += positions", "self.x += positions"))
    edits = no_edits()
    add = next(source.span_of(n) for n in source.positions if isinstance(n, cst.AugAssign))
    edits.site(add).result.append(Step("gather", 2))
    with pytest.raises(UserError, match="augmented assignment"):
        rewritten(source, edits)


def test_the_target_of_an_augmented_assignment_is_converted_and_rebound_on_the_line_before(tmp_path):
    """LED's `attn_scores += diagonal_mask` with attn_scores split and the add run whole: x is
    gathered on a line of its own, then added into (it was refused: cannot insert gather)."""
    source = parse(tmp_path, AUGMENTED_SOURCE)
    edits = no_edits()
    add = next(source.span_of(n) for n in source.positions if isinstance(n, cst.AugAssign))
    edits.site(add).args[("self",)] = [Step("gather", 2)]
    code, ctx = rewritten(source, edits)
    assert (f"        x = tp_gather(x, TP, dim=2)  # {GATHER_NOTE}\n"
            f"        x += positions\n") in code
    assert ctx.used == {"tp_gather", "TP"}
    compile(code, "model.py", "exec")
