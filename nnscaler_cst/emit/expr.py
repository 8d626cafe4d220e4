"""Small LibCST expression builders shared by the rewrite concerns."""
from __future__ import annotations

import libcst as cst

from ..materialize.conversions import SPLIT_DIM_STEPS, Step

_LOOSE = (cst.Add, cst.Subtract, cst.LeftShift, cst.RightShift, cst.BitAnd, cst.BitOr, cst.BitXor)

COLLECTIVE_NOTES = {
    "copy": ("tp_copy", "fwd: identity, bwd: all-reduce"),
    "reduce": ("tp_reduce", "fwd: all-reduce, bwd: identity"),
    "gather": ("tp_gather", "fwd: all-gather, bwd: keep own slice"),
    "scatter": ("tp_scatter", "fwd: keep own slice, bwd: all-gather"),
    "reduce_scatter": ("tp_reduce_scatter", "fwd: reduce-scatter, bwd: all-gather"),
    "all_gather": ("tp_all_gather", "fwd: all-gather, bwd: reduce-scatter"),
}


def code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def parenthesized(expr: cst.BaseExpression) -> cst.BaseExpression:
    if expr.lpar:
        return expr
    return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def needs_parens_for_floordiv(expr: cst.BaseExpression) -> bool:
    if expr.lpar:
        return False
    if isinstance(expr, cst.BinaryOperation):
        return isinstance(expr.operator, _LOOSE)
    return isinstance(expr, (cst.BooleanOperation, cst.Comparison, cst.IfExp, cst.Lambda, cst.NamedExpr)) or (
        isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not))


def divided(expr: cst.BaseExpression, divisor: int) -> cst.BaseExpression:
    """`expr // divisor`, keeping the user's expression and adding parentheses only if needed."""
    left = parenthesized(expr) if needs_parens_for_floordiv(expr) else expr
    return cst.BinaryOperation(left, cst.FloorDivide(whitespace_before=cst.SimpleWhitespace(" "),
                                                      whitespace_after=cst.SimpleWhitespace(" ")),
                               cst.Integer(str(divisor)))


def collective(step: Step, expr: cst.BaseExpression, axis: str) -> cst.Call:
    name = COLLECTIVE_NOTES[step.op][0]
    text = f"{name}(__x__, {axis}"
    if step.op in SPLIT_DIM_STEPS:
        text += f", dim={step.dim}" + (f", groups={step.groups}" if step.groups > 1 else "")
    call = cst.parse_expression(text + ")")
    return call.with_changes(args=[call.args[0].with_changes(value=expr), *call.args[1:]])


def bias_added(expr: cst.BaseExpression, bias: cst.BaseExpression) -> cst.BinaryOperation:
    return cst.BinaryOperation(expr, cst.Add(whitespace_before=cst.SimpleWhitespace(" "),
                                             whitespace_after=cst.SimpleWhitespace(" ")), bias)
