"""Apply planned edits to one source file in one LibCST traversal.

Each concern is a class of its own with a one-line DESCRIPTION (shard constructors, local
sizes, collectives); they share one traversal because every edit is keyed by the position
of a node in the *original* file, which a previous traversal would shift. Statement comments
are appended last, keeping the user's own comment.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from ..errors import UserError
from ..materialize.edits import CtorEdit, Edits, SiteEdit
from ..materialize.size_args import factory_size
from ..plan.instances import MethodGroups
from ..plan.pipeline import Branch, branch_body, if_branches
from ..source.files import SourceFile, Span
from ..source.names import bound_on_every_path
from .expr import COLLECTIVE_NOTES, bias_added, code, collective, divided, parenthesized
from .variants import with_variants

AXIS = "TP"
_LOOSER_THAN_ADD = (cst.LeftShift, cst.RightShift, cst.BitAnd, cst.BitXor, cst.BitOr)


@dataclass
class StageSplit:
    """Cut the function that loops over the blocks into pipeline stages (plan/pipeline.py)."""

    function: Span
    loop_index: int
    handoff: list[str]
    container: str
    owned: bool = False       # the function also runs other blocks: cut only the call on the trunk's owner
    recycle: Span | None = None     # the loop running the trunk N times (3F1B): one pass per action
    carried: tuple[str, ...] = ()   # what one pass of it hands the next
    unset: tuple[str, ...] = ()     # hand-off names the first stage may not have bound: None first
    replays: tuple[Span, ...] = ()  # prologue calls that change state later stages hold: run there too
    chained: bool = False           # one trunk of a chain: its `self` says the stage's part (runtime pp_trunk)
    recycle_after: bool = False     # the last pass is written after the recycling loop, which runs the others
    # a chain of statements (no loop): per later stage, the body index where it starts and what it receives
    cuts: tuple[tuple[int, tuple[str, ...]], ...] = ()
    hoist: str | None = None        # `return self.stages(x)`: the call moved out as `x = self.stages(x)`
    # the chain of statements runs in the branch of an `if` the trace took: the cuts count the body with
    # the `if` replaced by that branch's statements; where the `if` is (file:line), for its guard
    branch: Branch | None = None
    branch_at: str = ""
    iterations: bool = False        # blocks that are lists of modules: the stage runs its blocks' iterations


@dataclass
class Context:
    """What the concerns share while rewriting one file."""

    edits: Edits
    split: StageSplit | None = None
    chain: tuple[StageSplit, ...] = ()    # the functions of chained trunks in this file
    notes: dict[Span, list[str]] = field(default_factory=dict)    # node span -> comment fragments
    used: set[str] = field(default_factory=set)                   # _comm names the file now calls
    needs_torch: bool = False
    visited: set[Span] = field(default_factory=set)               # expression spans the concerns saw
    containers: dict[Span, list[tuple[str, ...]]] = field(default_factory=dict)  # nn.Sequential call -> leaves
    mixed: frozenset = frozenset()      # nn.Sequential calls whose calls run different layers
    unsliceable: frozenset = frozenset()    # nn.Sequential calls whose class a slice cannot rebuild
    before: list[cst.SimpleStatementLine] = field(default_factory=list)  # go before the current statement
    after: list[cst.SimpleStatementLine] = field(default_factory=list)   # go after the current statement
    assigned: dict[Span, list] = field(default_factory=dict)     # `x[i] = v` target span -> steps for v
    # the block calls --recompute checkpoints, each with the buffers its blocks' forward writes
    recompute: dict[Span, tuple[str, ...]] = field(default_factory=dict)
    in_program: bool = True         # the file becomes a rank's program (False: a mirror the stages share)
    value_first: bool = False       # the current statement's value was moved to a line of its own before it
    instance_classes: dict[str, str] = field(default_factory=dict)   # instance -> its variant class (emit/variants.py)
    variants: dict[str, list] = field(default_factory=dict)          # class -> its variant classes, to write after it

    def note(self, span: Span, text: str) -> None:
        fragments = self.notes.setdefault(span, [])
        if text not in fragments:
            fragments.append(text)

    def use(self, span: Span | None, step) -> None:
        """The file calls this step's collective; say at `span` what it does."""
        name, meaning = COLLECTIVE_NOTES[step.op]
        self.used.update({name, AXIS})
        if span is not None:
            self.note(span, f"{name}: {meaning}")


def _arg_index(call: cst.Call, path: tuple) -> int | None:
    if path[0] == "pos":
        positional = [i for i, a in enumerate(call.args) if a.keyword is None and not a.star]
        return positional[path[1]] if path[1] < len(positional) else None
    if path[0] == "kw":
        return next((i for i, a in enumerate(call.args) if a.keyword and a.keyword.value == path[1]), None)
    return None


def _plain_item(listed: cst.Tuple | cst.List, item: int) -> bool:
    """The item-th element is written out (no `*rest` before or at it)."""
    return item < len(listed.elements) and not any(isinstance(e, cst.StarredElement)
                                                   for e in listed.elements[:item + 1])


def _replace_arg(call: cst.Call, index: int, value: cst.BaseExpression) -> cst.Call:
    args = list(call.args)
    args[index] = args[index].with_changes(value=value)
    return call.with_changes(args=args)


class ShardConstructors:
    DESCRIPTION = "Divide the constructor arguments that size a split parameter."

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def leave(self, span: Span, node: cst.CSTNode) -> cst.CSTNode:
        edits = self.ctx.edits.ctors.get(span)
        if not edits or not isinstance(node, cst.Call):
            return node
        for edit in edits:
            node = self._apply(span, node, edit)
            self.ctx.note(span, edit.note)
        return node

    def _apply(self, span: Span, call: cst.Call, edit: CtorEdit) -> cst.Call:
        if edit.aliases[0].startswith("factory:"):     # nn.Parameter(torch.ones(a, b)), or `scale * torch.ones(n)`
            size = factory_size(call, int(edit.aliases[0].split(":")[1]), edit.rank)
            if isinstance(size, str):       # the plan keeps such a parameter whole: not expected here
                raise UserError(f"cannot find the size argument of this parameter's factory call: {size}",
                                span.start)
            return call.deep_replace(size, divided(size, edit.divisor))
        for alias in edit.aliases:
            path = ("pos", int(alias[3:])) if re.fullmatch(r"arg\d+", alias) else ("kw", alias)
            index = _arg_index(call, path)
            if index is not None:
                return _replace_arg(call, index, divided(call.args[index].value, edit.divisor))
        raise UserError(f"the constructor call does not pass {'/'.join(edit.aliases)} explicitly; "
                        "cannot write its local size", span.start,
                        hint="pass the size as an argument in the model file")


class LocalSizes:
    DESCRIPTION = "Rewrite the size arguments of split views and splits to local sizes."

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def leave(self, span: Span, node: cst.CSTNode) -> cst.CSTNode:
        site = self.ctx.edits.sites.get(span)
        if site is None or not site.sizes or not isinstance(node, cst.Call):
            return node
        for edit in site.sizes:
            index = _arg_index(node, edit.path)
            if index is None:
                raise UserError("cannot find the size argument to make local", span.start)
            value = node.args[index].value
            if edit.item is None:
                self.ctx.note(span, f"local size: {code(value)} / {edit.divisor}")
                node = _replace_arg(node, index, divided(value, edit.divisor))
            elif isinstance(value, (cst.Tuple, cst.List)) and edit.item < len(value.elements) and not isinstance(
                    value.elements[edit.item], cst.StarredElement):
                elements = list(value.elements)
                element = elements[edit.item]
                elements[edit.item] = element.with_changes(value=divided(element.value, edit.divisor))
                self.ctx.note(span, f"local size: {code(element.value)} / {edit.divisor}")
                node = _replace_arg(node, index, value.with_changes(elements=elements))
            else:
                raise UserError(f"the size of split dim {edit.item} comes from `{code(value)}`, which the "
                                "rewrite cannot make local", span.start,
                                hint="write the sizes out in the call, or use -1 for the split dim")
        return node


def _rebound(name: cst.Name, steps, ctx: Context) -> cst.SimpleStatementLine:
    """`x = collective(x)  # meaning`: a line of its own converting and rebinding a name."""
    value: cst.BaseExpression = name
    for step in steps:
        value = collective(step, value, AXIS)
        ctx.use(None, step)     # the comment goes on the new line
    comment = "; ".join(f"{n}: {m}" for n, m in (COLLECTIVE_NOTES[s.op] for s in steps))
    return cst.SimpleStatementLine(
        [cst.Assign([cst.AssignTarget(name)], value)],
        trailing_whitespace=cst.TrailingWhitespace(cst.SimpleWhitespace("  "), cst.Comment(f"# {comment}")))


class InsertCollectives:
    DESCRIPTION = "Wrap arguments and results in named collectives; swap in split implementations."

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def leave(self, span: Span, node: cst.CSTNode) -> cst.CSTNode:
        site = self.ctx.edits.sites.get(span)
        if site is None:
            return node
        if site.writes:
            return self._convert_written(span, node, site)
        args = dict(site.args)
        node = self._wrap_sequences(span, node, args, site.lengths)
        for path, steps in args.items():
            node = self._wrap_operand(span, node, path, steps)
        bias = self._bias(span, node, site) if site.bias is not None else None
        if site.replace is not None:
            node = self._replace(span, node, site)
        if site.result and isinstance(node, cst.AugAssign):
            if not isinstance(node.target, cst.Name):
                raise UserError("cannot convert the result of an augmented assignment in place", span.start,
                                hint="write `x = x + y` instead of `x += y` here")
            self.ctx.after.append(_rebound(node.target, site.result, self.ctx))   # `x += y`, then x converted
            return node
        for k, step in enumerate(site.result):
            if step.op in ("reduce", "reduce_scatter") and bias is not None and k == 0:   # scattered off its dim
                node = bias_added(collective(step, node, AXIS), bias)
            else:
                node = collective(step, node, AXIS)
            self.ctx.use(span, step)
        return node

    def _convert_written(self, span: Span, target: cst.CSTNode, site: SiteEdit) -> cst.CSTNode:
        """`x[i] = v` whose x or v arrives in another layout: x is converted and rebound on a line
        before the statement (writing into the converted tensor *is* the write the rest of the
        code reads), v is converted where it is assigned."""
        for path, steps in site.args.items():
            if path == ("pos", 1):
                self.ctx.assigned[span] = steps
                continue
            if not (isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name)):
                raise UserError(f"cannot insert {'+'.join(s.op for s in steps)} on the tensor written here",
                                span.start, hint="write into a plain variable: `y = ...; y[i] = v`")
            self.ctx.before.append(_rebound(target.value, steps, self.ctx))
        return target

    def _wrap_sequences(self, span, node, args: dict, lengths: dict[tuple, int]):
        """Every element of a sequence argument that is not written out (`torch.stack(states, 1)`)
        converted alike: a comprehension over it, `[tp_scatter(t, ...) for t in states]`. Each path
        handled here leaves `args`; a written-out list or tuple, and elements converted unalike,
        are left to _wrap_operand."""
        if not isinstance(node, cst.Call):
            return node
        groups: dict[tuple, dict[int, list]] = {}
        for path, steps in args.items():
            if len(path) == 3 and path[:2] in lengths:
                groups.setdefault(path[:2], {})[path[2]] = steps
        for where, items in groups.items():
            index = _arg_index(node, where)
            if index is None or isinstance(node.args[index].value, (cst.Tuple, cst.List)):
                continue
            first = next(iter(items.values()))
            if len(items) != lengths[where] or any(steps != first for steps in items.values()):
                continue
            element = cst.Name("t")
            converted: cst.BaseExpression = element
            for step in first:
                converted = collective(step, converted, AXIS)
                self.ctx.use(span, step)
            node = _replace_arg(node, index, cst.ListComp(converted, cst.CompFor(target=element,
                                                                                  iter=node.args[index].value)))
            for k in items:
                del args[(*where, k)]
        return node

    def _wrap_operand(self, span, node, path, steps):
        def wrap(expr):
            for step in steps:
                expr = collective(step, expr, AXIS)
                self.ctx.use(span, step)
            return expr

        if isinstance(node, cst.Call) and path[0] in ("pos", "kw"):
            index = _arg_index(node, path)
            if index is not None and len(path) == 2:
                return _replace_arg(node, index, wrap(node.args[index].value))
            splat = [i for i, a in enumerate(node.args) if a.star == "**"]
            if index is None and path[0] == "kw" and len(path) == 2 and len(splat) == 1:
                # `f(**kwargs)`: the one value overridden in a copy, `f(**{**kwargs, "x": conv(kwargs["x"])})`
                mapping = node.args[splat[0]].value
                key = cst.SimpleString(repr(path[1]))
                item = cst.Subscript(mapping, [cst.SubscriptElement(cst.Index(key))])
                return _replace_arg(node, splat[0], cst.Dict([cst.StarredDictElement(mapping),
                                                              cst.DictElement(key, wrap(item))]))
            listed = node.args[index].value if index is not None else None
            if isinstance(listed, (cst.Tuple, cst.List)) and _plain_item(listed, path[2]):  # `torch.cat((a, b))`
                elements = list(listed.elements)
                elements[path[2]] = elements[path[2]].with_changes(value=wrap(elements[path[2]].value))
                return _replace_arg(node, index, listed.with_changes(elements=elements))
        if isinstance(node, cst.Call) and path == ("self",) and isinstance(node.func, cst.Attribute):
            return node.with_changes(func=node.func.with_changes(value=wrap(node.func.value)))
        if isinstance(node, cst.BinaryOperation):
            if path == ("self",):
                return node.with_changes(left=wrap(node.left))
            if path == ("pos", 0):
                return node.with_changes(right=wrap(node.right))
        if isinstance(node, cst.Subscript) and path == ("self",):
            return node.with_changes(value=wrap(node.value))
        if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
            if path == ("self",):
                return node.with_changes(left=wrap(node.left))
            if path == ("pos", 0):
                target = node.comparisons[0]
                return node.with_changes(comparisons=[target.with_changes(comparator=wrap(target.comparator))])
        if isinstance(node, cst.UnaryOperation) and path == ("self",):
            return node.with_changes(expression=wrap(node.expression))
        if isinstance(node, cst.AugAssign) and path == ("pos", 0):
            return node.with_changes(value=wrap(node.value))
        if isinstance(node, cst.AugAssign) and path == ("self",) and isinstance(node.target, cst.Name):
            self.ctx.before.append(_rebound(node.target, steps, self.ctx))   # x converted, then `x += y`
            return node
        raise UserError(f"cannot insert {'+'.join(s.op for s in steps)} on this argument", span.start,
                        hint="assign the value to a variable and pass that")

    def _template_values(self, span, call: cst.Call) -> dict[str, str]:
        values = {"self": code(call.func)}
        positional = [a for a in call.args if a.keyword is None and not a.star]
        for i, arg in enumerate(positional):
            values[f"arg{i}"] = code(arg.value)
        keywords = [a for a in call.args if a.keyword is not None or a.star]
        values["kwargs"] = "".join(", " + code(a).strip().rstrip(",").strip() for a in keywords)   # one per line too
        for i in range(len(positional) + 1):      # {restN}: the arguments from the Nth positional on
            values[f"rest{i}"] = "".join(", " + code(a.value) for a in positional[i:]) + values["kwargs"]
        return values

    def _replace(self, span, node, site: SiteEdit):
        if not isinstance(node, cst.Call):
            raise UserError("only a call can be replaced by a split implementation", span.start)
        template = site.replace
        try:
            text = template.format(**{**site.traced, **self._template_values(span, node)})
        except (KeyError, IndexError) as exc:
            raise UserError(f"the call does not pass {exc} that `{template}` needs", span.start) from None
        self.ctx.needs_torch |= "torch." in text
        function = template.split("(")[0]
        if "." not in function:
            self.ctx.used.update({function} | {axis for axis in (AXIS, "DP") if re.search(rf"\b{axis}\b", text)})
        for note in site.notes:
            self.ctx.note(span, note)
        return cst.parse_expression(text)

    def _bias(self, span, call, site: SiteEdit) -> cst.BaseExpression:
        """The bias of a row-parallel call, read before the call is replaced."""
        if not isinstance(call, cst.Call):
            raise UserError("a row-parallel bias needs a call", span.start)
        text = f"{code(call.func)}.{site.bias[5:]}" if site.bias.startswith("self.") else \
            self._template_values(span, call)[site.bias]
        if site.bias_trailing:         # a conv's channels: broadcast over the spatial dims after them
            text = f"{text}[:{', None' * site.bias_trailing}]"
        return cst.parse_expression(text)


class RecomputeBlocks:
    DESCRIPTION = "Run each block under torch.utils.checkpoint where the loop over the blocks calls it."

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def leave(self, span: Span, node: cst.CSTNode) -> cst.CSTNode:
        if span not in self.ctx.recompute:
            return node
        collectives = {name for name, _ in COLLECTIVE_NOTES.values()}
        call = node
        while isinstance(call, cst.Call) and code(call.func) in collectives:   # a conversion on its result
            call = call.args[0].value
        if not isinstance(call, cst.Call):
            raise UserError("--recompute found no call of the block here (please report it)", span.start)
        restored = self.ctx.recompute[span]      # buffers the block's forward writes
        kept = f", context_fn=buffers_kept_through_recompute({code(call.func)}, {restored!r})" if restored else ""
        template = cst.parse_expression(f"torch.utils.checkpoint.checkpoint(block, use_reentrant=False{kept})")
        if restored:
            self.ctx.used.add("buffers_kept_through_recompute")
        args = list(call.args)
        # the user's layout kept: one argument per line stays so, a trailing comma stays last
        between = args[0].comma if args and isinstance(args[0].comma, cst.Comma) else cst.MaybeSentinel.DEFAULT
        flags = list(template.args[1:])
        if args and isinstance(args[-1].comma, cst.Comma):
            flags[-1] = flags[-1].with_changes(comma=args[-1].comma)
            args[-1] = args[-1].with_changes(comma=between)
        checkpointed = template.with_changes(args=[cst.Arg(call.func, comma=between), *args, *flags],
                                             whitespace_before_args=call.whitespace_before_args)
        self.ctx.needs_torch = True
        self.ctx.note(span, "recompute: the block keeps only its inputs; backward reruns its forward"
                      + (", its buffers put back as the forward left them" if restored else ""))
        return node.deep_replace(call, checkpointed) if call is not node else checkpointed


class CoshardRegions:
    DESCRIPTION = "Run each co-shard region as a local function, its pieces one after another."

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def leave_block(self, span: Span, block: cst.IndentedBlock) -> cst.IndentedBlock:
        regions = sorted((r for r in self.ctx.edits.regions if r.block == span), key=lambda r: -r.first)
        if not regions:
            return block
        body = list(block.body)
        for region in regions:
            statements = body[region.first:region.last + 1]
            name = "_" + "_".join(region.outputs) + "_in_pieces"
            params = ", ".join(n for n, _ in region.inputs)
            results = ", ".join(region.outputs)
            dims = ", ".join(str(d) for _, d in region.inputs) + ("," if len(region.inputs) == 1 else "")
            define = cst.parse_statement(
                f"def {name}({params}):  # coshard: {region.chunks} pieces per device, one after another, "
                f"recomputed in backward\n    return {results}\n")
            first = statements[0].with_changes(leading_lines=[])
            define = define.with_changes(leading_lines=statements[0].leading_lines, body=define.body.with_changes(
                body=[first, *statements[1:], *define.body.body]))
            call = cst.parse_statement(f"{results} = coshard({name}, {region.chunks}, in_dims=({dims}), "
                                       f"out_dims={region.out_dim})({params})\n")
            body[region.first:region.last + 1] = [define, call]
        self.ctx.used.add("coshard")
        return block.with_changes(body=body)


def _branch_guard(statement: cst.If, taken: int, where: str) -> cst.If:
    """`if <the trace's branch is not taken>: raise RuntimeError(...)`, in the `if`'s place: the
    conditions of the branches before the taken one, and the negated condition of the taken one."""
    branches = if_branches(statement)
    test, _ = branches[taken]
    tests = [code(_grouped(t, _LOOSER_THAN_OR)) for t, _ in branches[:taken]]
    if test is not None:
        tests.append(f"not {code(_grouped(test, _LOOSER_THAN_NOT))}")
    name = "the `else` branch" if test is None else "the first branch" if taken == 0 else \
        f"branch {taken + 1} (an `elif`)"
    guard = cst.parse_statement(
        f"if {' or '.join(tests)}:  # pipeline: the stages run {name}, the one the trace took\n"
        f"    raise RuntimeError(\"pipeline: the stages run {name} of the `if` at {where}, the one the trace \"\n"
        f"                       \"took; its condition now chooses another, which no stage can run\")\n")
    return guard.with_changes(leading_lines=statement.leading_lines)


# expressions that need parentheses as an operand of `or`, and of `not`
_LOOSER_THAN_OR = (cst.IfExp, cst.Lambda, cst.NamedExpr)
_LOOSER_THAN_NOT = (*_LOOSER_THAN_OR, cst.BooleanOperation, cst.Comparison)


def _grouped(expr: cst.BaseExpression, looser: tuple) -> cst.BaseExpression:
    return parenthesized(expr) if isinstance(expr, looser) else expr


class SplitStages:
    DESCRIPTION = "Guard the prologue to stage 0, receive what it defines elsewhere, hand off after the loop."

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def leave_function(self, span: Span, function: cst.FunctionDef) -> cst.FunctionDef:
        chained = next((c for c in self.ctx.chain if c.function == span), None)
        if chained is not None:
            return self._chained(chained, function)
        split = self.ctx.split
        if split is None or span != split.function:
            return function
        if split.cuts:
            return self._statements(split, function)
        body = list(function.body.body)
        docstring = body[:1] if body and _is_docstring(body[0]) else []
        index = split.loop_index
        if split.hoist is not None:
            body[index:index + 1] = self._hoisted(body[index], split)
        prologue, loop, epilogue = body[len(docstring):index], body[index], body[index + 1:]
        handed = list(split.handoff)
        calls = None
        if split.replays:       # the state-changing calls the first stage ran go with the hand-off
            taken = set(_names_in(function))
            calls = next(n for n in ("pp_calls", *(f"pp_calls{k}" for k in range(2, 100))) if n not in taken)
            self.ctx.used.update({"pp_replays", "pp_replay"})
        names = ", ".join([*handed, *([calls] if calls else [])]) + ("," if len(handed) + bool(calls) == 1 else "")
        self.ctx.used.update({"pp_first_stage", "pp_receive", "pp_handoff"} | ({"pp_cuts"} if split.owned else set()))
        receive = cst.parse_statement(f"{names} = pp_receive()  # pipeline: from the previous stage\n")
        receive = [receive] if calls is None else [receive, cst.parse_statement(
            f"pp_replay(self, {calls})  # pipeline: run the calls before the blocks that changed module state "
            "here too, once\n")]
        head: list[cst.BaseStatement] = []
        first_stage = "pp_first_stage() or not pp_cuts(self)" if split.owned else "pp_first_stage()"
        later_stage = "not pp_first_stage() and pp_cuts(self)" if split.owned else "not pp_first_stage()"
        if prologue:
            guard = cst.parse_statement(f"if {first_stage}:  # pipeline: the first stage runs what precedes "
                                        "the blocks" + (" (and every stage, for this class's other blocks)"
                                                        if split.owned else "") + "\n    pass\nelse:\n    pass\n")
            first = [prologue[0].with_changes(leading_lines=[]), *prologue[1:]]
            guard = guard.with_changes(body=guard.body.with_changes(body=first),
                                       orelse=guard.orelse.with_changes(body=guard.orelse.body.with_changes(
                                           body=receive)), leading_lines=prologue[0].leading_lines)
            head = [guard]
        else:
            head = [cst.parse_statement(f"if {later_stage}:\n    {names} = pp_receive()\n")]
        mark = cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(
            f"# pipeline: this stage's blocks of {split.container} only"))
        blocks = "STAGE_BLOCKS" if self.ctx.in_program else ""    # a mirror is shared by the stages
        offset = f"(pp_first_block({blocks}) if pp_cuts(self) else 0)" if split.owned \
            else f"pp_first_block({blocks})"
        if isinstance(loop, cst.For) and split.iterations:
            loop = self._iterations(loop, mark, split.container, split.owned)
        elif isinstance(loop, cst.For):
            loop = loop.with_changes(iter=self._count_from_first_block(loop.iter, offset, "pp_first_block"),
                                     body=loop.body.with_changes(header=mark))
        elif isinstance(loop, cst.If):      # branches, each running the blocks in its own way
            loop = self._count_branches_from_first_block(loop, offset).with_changes(leading_lines=[
                *loop.leading_lines, cst.EmptyLine(indent=True, comment=cst.Comment(
                    f"# pipeline: each branch runs this stage's blocks of {split.container} only"))])
        elif loop.trailing_whitespace.comment is None:      # `x = self.blocks(x)` on an nn.Sequential
            loop = loop.with_changes(trailing_whitespace=mark)
        given = ", ".join([*handed, *(["pp_replays(self)"] if calls else [])])
        handoff = cst.parse_statement(f"pp_handoff({given})  # pipeline: every stage but the "
                                      "last hands these on and ends here\n")
        if split.owned:
            handoff = cst.parse_statement(f"if pp_cuts(self):\n    pp_handoff({given})  "
                                          "# pipeline: every stage but the last hands these on and ends here\n")
        if split.unset:     # set only under a condition before the hand-off: handed on as None when unset
            unset = cst.parse_statement(f"{' = '.join(split.unset)} = None  # pipeline: set before the hand-off "
                                        "only under a condition; handed on as None when unset\n")
            head = [unset.with_changes(leading_lines=head[0].leading_lines),
                    head[0].with_changes(leading_lines=[]), *head[1:]]
        return function.with_changes(body=function.body.with_changes(
            body=[*docstring, *head, loop, handoff, *epilogue]))


    def _hoisted(self, statement: cst.SimpleStatementLine, split: StageSplit) -> list[cst.SimpleStatementLine]:
        """`return self.stages(x)` -> `x = self.stages(x)` (the call the stages cut), then `return x`."""
        attr = split.container.rpartition(".")[2]
        found = []

        class Find(cst.CSTVisitor):
            def visit_Call(self, call: cst.Call) -> None:
                if isinstance(call.func, cst.Attribute) and call.func.attr.value == attr and len(call.args) == 1 \
                        and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == split.hoist:
                    found.append(call)
        statement.visit(Find())
        call = found[0]
        name = cst.Name(split.hoist)
        first = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(name)], call)],
                                        leading_lines=statement.leading_lines)
        note = cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(
            f"# pipeline: the call of self.{attr} moved to the line above, which the stages cut"))
        rest = statement.deep_replace(call, name).with_changes(leading_lines=[], trailing_whitespace=note)
        return [first, rest]

    def _statements(self, split: StageSplit, function: cst.FunctionDef) -> cst.FunctionDef:
        """A function written as a chain of statements, cut between them: stage j runs its run of
        statements under `if pp_stage() == j:`, from what it received (j > 0), and hands on at its
        end; the last stage skips the earlier runs, receives, and runs the rest as written."""
        body = list(function.body.body)
        start = 1 if body and _is_docstring(body[0]) else 0
        branch_guard, in_branch = None, range(0)
        if split.branch is not None:    # the `if`'s condition stays as a guard before the branch's statements
            statement = body[split.branch.index]
            branch_guard = _branch_guard(statement, split.branch.taken, split.branch_at)
            _, taken = if_branches(statement)[split.branch.taken]
            in_branch = range(split.branch.index, split.branch.index + len(taken.body))
            body = branch_body(body, split.branch)
        bounds = [start, *(k for k, _ in split.cuts), len(body)]
        received = [None, *(names for _, names in split.cuts)]
        params = function.params
        bound = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)} | {
            star.name.value for star in (params.star_arg, params.star_kwarg) if isinstance(star, cst.Param)}
        self.ctx.used.update({"pp_stage", "pp_handoff"} | ({"pp_receive"} if split.cuts else set()))
        out = body[:start]
        last = len(bounds) - 2
        for j in range(last + 1):
            run = body[bounds[j]:bounds[j + 1]]
            entered = next((k for k in range(bounds[j], bounds[j + 1]) if k in in_branch), None)
            if entered is not None:     # every stage running some of the branch checks it is still the one
                run.insert(entered - bounds[j], branch_guard if entered == split.branch.index
                           else branch_guard.with_changes(leading_lines=[]))
            head = []
            if j:
                names = received[j]
                text = f"{', '.join(names)}{',' if len(names) == 1 else ''} = pp_receive()" if names \
                    else "pp_receive()"
                head.append(cst.parse_statement(f"{text}  # pipeline: stage {j} starts here, from what stage "
                                                f"{j - 1} handed on\n"))
            if j == last:
                out += [*head, *run]
                break
            handed = split.cuts[j][1]
            after = bound_on_every_path(run, bound | set(received[j] or ())) or set()
            unset = [name for name in handed if name not in after]
            if unset:
                head.append(cst.parse_statement(f"{' = '.join(unset)} = None  # pipeline: set below only under a "
                                                "condition; handed on as None when unset\n"))
            handoff = cst.parse_statement(f"pp_handoff({', '.join(handed)})  # pipeline: stage {j} hands these on "
                                          "and ends here\n")
            guard = cst.parse_statement(f"if pp_stage() == {j}:  # pipeline: stage {j} runs these statements\n"
                                        "    pass\n")
            lead = run[0].leading_lines
            run[0] = run[0].with_changes(leading_lines=[])
            out.append(guard.with_changes(leading_lines=lead,
                                          body=guard.body.with_changes(body=[*head, *run, handoff])))
        return function.with_changes(body=function.body.with_changes(body=out))

    def leave_call(self, span: Span, call: cst.BaseExpression) -> cst.BaseExpression:
        """`self.set_attention_type("original_full")` before the blocks, which changes state later
        stages hold, becomes `pp_replayed(self, "set_attention_type", "original_full")`: it runs
        here and is noted, and every later stage runs it too (pp_replay after pp_receive)."""
        split = self.ctx.split
        if split is None or span not in split.replays or not isinstance(call, cst.Call) \
                or not isinstance(call.func, cst.Attribute):
            return call
        path, target = [], call.func
        while isinstance(target, cst.Attribute):
            path.insert(0, target.attr.value)
            target = target.value
        if not (isinstance(target, cst.Name) and target.value == "self"):
            return call
        self.ctx.used.add("pp_replayed")
        self.ctx.note(span, "pipeline: later stages run this call too (it changes state of modules they hold)")
        method = cst.Arg(cst.SimpleString('"' + ".".join(path) + '"'), comma=cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" ")) if call.args else cst.MaybeSentinel.DEFAULT)
        return call.with_changes(func=cst.Name("pp_replayed"), args=[
            cst.Arg(cst.Name("self"), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), method,
            *call.args])

    def _chained(self, split: StageSplit, function: cst.FunctionDef) -> cst.FunctionDef:
        """A function looping over one trunk of a chain (an encoder's blocks, then a decoder's): a
        stage past the trunk returns what it returned on the stage that ran it; the stage reaching it
        first runs the code before the blocks, a stage starting inside it receives instead; a stage
        whose blocks end in it hands on after them; what it returns is noted for the later stages."""
        function = function.visit(_NoteReturns())
        body = list(function.body.body)
        docstring = body[:1] if body and _is_docstring(body[0]) else []
        index = split.loop_index
        prologue, loop, epilogue = body[len(docstring):index], body[index], body[index + 1:]
        handed = list(split.handoff)
        self.ctx.used.update({"pp_skips", "pp_passed", "pp_enters", "pp_received", "pp_hand_on", "pp_returns"})
        skip = cst.parse_statement("if pp_skips(self):  # pipeline: this stage starts after these blocks; what they "
                                   "returned came with the hand-off\n    return pp_passed(self)\n")
        names = ", ".join(handed) + ("," if len(handed) == 1 else "")
        receive = cst.parse_statement((f"{names} = " if handed else "") + "pp_received(self)  # pipeline: from the "
                                      "previous stage\n")
        if prologue:
            guard = cst.parse_statement("if pp_enters(self):  # pipeline: the stage reaching these blocks first runs "
                                        "what precedes them\n    pass\nelse:\n    pass\n")
            first = [prologue[0].with_changes(leading_lines=[]), *prologue[1:]]
            guard = guard.with_changes(body=guard.body.with_changes(body=first),
                                       orelse=guard.orelse.with_changes(body=guard.orelse.body.with_changes(
                                           body=[receive])), leading_lines=prologue[0].leading_lines)
        else:
            guard = cst.parse_statement("if not pp_enters(self):\n    pass\n")
            guard = guard.with_changes(body=guard.body.with_changes(body=[receive]))
        head = [skip.with_changes(leading_lines=guard.leading_lines), guard.with_changes(leading_lines=[])]
        if split.unset:
            head.insert(1, cst.parse_statement(f"{' = '.join(split.unset)} = None  # pipeline: may be unset where "
                                               "this stage hands on; handed on as None then\n"))
        mark = cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(
            "# pipeline: this stage's blocks of this list only"))
        if isinstance(loop, cst.For) and split.iterations:
            loop = self._iterations(loop, mark, "this list", True)
        elif isinstance(loop, cst.For):
            loop = loop.with_changes(iter=self._count_from_first_block(loop.iter, "pp_first_block_of(self)",
                                                                       "pp_first_block_of"),
                                     body=loop.body.with_changes(header=mark))
        handoff = cst.parse_statement(f"pp_hand_on({', '.join(['self', *handed])})  # pipeline: a stage whose "
                                      "blocks end in this list hands these on and ends here\n")
        return function.with_changes(body=function.body.with_changes(
            body=[*docstring, *head, loop, handoff, *epilogue]))

    def _iterations(self, loop: cst.For, mark: cst.TrailingWhitespace, blocks: str, owned: bool) -> cst.For:
        """`for ... in pp_iterations(ITER)`: the loop runs blocks that are lists of modules, one per
        iteration; the stage runs the iterations of its own blocks. `owned`: the function also runs
        other blocks (or is one trunk of a chain), whose part `self` says."""
        self.ctx.used.add("pp_iterations")
        args = [cst.Arg(loop.iter)]
        if owned:
            args = [args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                    cst.Arg(cst.Name("self"))]
        return loop.with_changes(iter=cst.Call(cst.Name("pp_iterations"), args), body=loop.body.with_changes(
            header=mark.with_changes(comment=cst.Comment(f"# pipeline: the iterations of this stage's blocks of "
                                                         f"{blocks} only"))))

    def _count_branches_from_first_block(self, branches: cst.If, offset_code: str) -> cst.If:
        """Each branch's `for i, blk in enumerate(self.blocks):` counts from the stage's first block."""
        orelse = branches.orelse
        if isinstance(orelse, cst.If):
            orelse = self._count_branches_from_first_block(orelse, offset_code)
        elif isinstance(orelse, cst.Else):
            orelse = orelse.with_changes(body=self._count_block_loop(orelse.body, offset_code))
        return branches.with_changes(body=self._count_block_loop(branches.body, offset_code), orelse=orelse)

    def _count_block_loop(self, block: cst.BaseSuite, offset_code: str) -> cst.BaseSuite:
        loop = block.body[0] if isinstance(block, cst.IndentedBlock) and len(block.body) == 1 else None
        if not isinstance(loop, cst.For):
            return block
        return block.with_changes(body=[loop.with_changes(
            iter=self._count_from_first_block(loop.iter, offset_code, "pp_first_block"))])

    def _count_from_first_block(self, iterable: cst.BaseExpression, offset_code: str,
                                name: str) -> cst.BaseExpression:
        """`enumerate(self.layers)` counts a stage's blocks from its first one's index in the
        whole model (`self.config.layer_types[i]`): each stage holds only its blocks, from 0."""
        if not (isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Name)
                and iterable.func.value == "enumerate" and iterable.args and iterable.args[0].keyword is None):
            return iterable
        self.ctx.used.add(name)
        # a class whose other calls run their blocks whole (split.owned) counts those from 0
        offset = cst.parse_expression(offset_code)
        args = list(iterable.args)
        start = next((k for k, a in enumerate(args[1:], 1) if a.keyword is None or a.keyword.value == "start"), None)
        if start is None:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(cst.Arg(offset))
        else:
            args[start] = args[start].with_changes(value=cst.BinaryOperation(
                args[start].value, cst.Add(), offset) if not (isinstance(args[start].value, cst.Integer)
                                                              and args[start].value.value == "0") else offset)
        return iterable.with_changes(args=args)

    def leave_for(self, span: Span, loop: cst.For) -> cst.For:
        """Recycling (3F1B): each pipeline action runs one pass of the loop that runs the trunk N
        times. The first stage starts a later pass from the values the last stage handed back; the
        last stage ends every pass but the last by handing them back."""
        split = self.ctx.split
        if split is None or split.recycle is None or span != split.recycle:
            return loop
        self.ctx.used.update({"pp_passes", "pp_recycled", "pp_recycle"})
        names = ", ".join(split.carried)
        passes = [cst.Arg(loop.iter)]
        if split.recycle_after:
            passes = [passes[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                      cst.Arg(cst.Integer("1"), keyword=cst.Name("after"), equal=cst.AssignEqual(
                          cst.SimpleWhitespace(""), cst.SimpleWhitespace("")))]
        loop = loop.with_changes(
            iter=cst.Call(cst.Name("pp_passes"), passes),
            body=loop.body.with_changes(header=cst.TrailingWhitespace(
                whitespace=cst.SimpleWhitespace("  "),
                comment=cst.Comment("# pipeline (3F1B): the pass this step runs, one per pipeline action"))))
        if not split.carried or not isinstance(loop.body, cst.IndentedBlock):
            return loop
        take = cst.parse_statement(f"{names} = pp_recycled({names})  # pipeline: the first stage starts a later pass "
                                   "from what the last stage handed back\n")
        give = cst.parse_statement(f"pp_recycle({names})  # pipeline: the last stage hands these to the first "
                                   "stage and ends here, on every pass but the last\n")
        loop = loop.with_changes(body=loop.body.with_changes(body=[take, *loop.body.body, give]))
        if not split.recycle_after:
            return loop
        last = cst.parse_statement(f"{names} = pp_recycled({names})  # pipeline: so does the last pass, after "
                                   "the loop\n")
        return cst.FlattenSentinel([loop, last])


class _NoteReturns(cst.CSTTransformer):
    """`return x` -> `return pp_returns(self, x)` in a chained trunk's function (not in functions
    or classes defined inside it)."""

    def __init__(self):
        self.depth = 0

    def visit_FunctionDef(self, node) -> bool:
        self.depth += 1
        return self.depth == 1

    def leave_FunctionDef(self, original, updated):
        self.depth -= 1
        return updated

    def visit_ClassDef(self, node) -> bool:
        return False

    def visit_Lambda(self, node) -> bool:
        return False

    def leave_Return(self, original, updated):
        if updated.value is None:
            return updated
        value = updated.value
        if isinstance(value, cst.Tuple) and not value.lpar:     # `return x, intermediates`: one argument
            value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return updated.with_changes(value=cst.parse_expression("pp_returns(self, x)").with_changes(
            args=[cst.Arg(cst.Name("self"), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                  cst.Arg(value)]))


def _names_in(node: cst.CSTNode) -> set[str]:
    """Every name a piece of code spells: a new variable must not shadow any of them."""
    found: set[str] = set()

    class Names(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.add(name.value)

    node.visit(Names())
    return found


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr) and isinstance(
        stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))


class FileRewriter(cst.CSTTransformer):
    """Runs the concerns over one file and comments every statement they changed."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, source: SourceFile, ctx: Context):
        super().__init__()
        self.path = str(source.path)
        self.ctx = ctx
        self.concerns = [ShardConstructors(ctx), LocalSizes(ctx), InsertCollectives(ctx), RecomputeBlocks(ctx)]
        self.stages = SplitStages(ctx)
        self.regions = CoshardRegions(ctx)
        self.module = source.module
        self.taken: set[str] | None = None      # every name the file spells, once a new one is needed

    def _span(self, node) -> Span:
        rng = self.get_metadata(PositionProvider, node)
        return Span(self.path, rng.start.line, rng.start.column, rng.end.line, rng.end.column)

    def _leave_expr(self, original, updated):
        span = self._span(original)
        self.ctx.visited.add(span)
        if isinstance(updated, cst.Call) and self._layers_edited(span):
            return self._run_mixed(span, updated) if span in self.ctx.mixed else self._unroll(span, updated)
        for concern in self.concerns:
            updated = concern.leave(span, updated)
        return self.stages.leave_call(span, updated) if isinstance(updated, cst.Call) else updated

    def _layer_edit(self, span: Span, via: tuple[str, ...]) -> SiteEdit | None:
        site = self.ctx.edits.sites.get(dataclasses.replace(span, via=via))
        return site if site is not None and (site.result or site.args or site.sizes or site.replace) else None

    def _layers_edited(self, span: Span) -> bool:
        if span in self.ctx.mixed:
            return bool(self._mixed_edits(span))
        return any(self._layer_edit(span, via) for via in self.ctx.containers.get(span, ()))

    def _mixed_edits(self, span: Span) -> dict[Span, SiteEdit]:
        """The edits of the layers of an nn.Sequential whose calls run different layers, whichever
        call ran them."""
        return {s: e for s, e in self.ctx.edits.sites.items() if s.via and dataclasses.replace(s, via=()) == span
                and (e.result or e.args or e.sizes or e.replace)}

    def _run_mixed(self, span: Span, call: cst.Call) -> cst.BaseExpression:
        """An nn.Sequential whose calls from this line run different layers (blocks built with and
        without a layer) cannot be cut apart in this one line: the planner splits none of its
        layers, and data parallelism replaces the whole call (`dp_layers`, materialize/edits.py);
        an edit between its layers has no place to go."""
        raise UserError(f"`{code(call.func)}` is an nn.Sequential whose calls from this line run different "
                        "layers, and the plan needs edits between its layers: one line cannot hold them",
                        span.start, hint="call the layers one by one in the model's forward, or keep them whole")

    def _runs(self, span: Span) -> list[list[tuple[str, ...]]]:
        """The container's layers cut where an edit must go between them: a layer whose input is
        converted starts a run, one whose result is converted ends it, a replaced one stands alone."""
        layers = self.ctx.containers[span]
        if span in self.ctx.unsliceable or any(len(via) > 1 or not via[0].isdigit() for via in layers):
            return [[via] for via in layers]    # nested, named, or a class a slice cannot rebuild: one by one
        runs: list[list[tuple[str, ...]]] = [[]]
        for via in layers:
            edit = self._layer_edit(span, via)
            if edit and (edit.args or edit.replace or edit.sizes) and runs[-1]:
                runs.append([])
            runs[-1].append(via)
            if edit and (edit.result or edit.replace or edit.sizes):
                runs.append([])
        return [run for run in runs if run]

    def _unroll(self, span: Span, call: cst.Call) -> cst.BaseExpression:
        """`self.head(h)` on an nn.Sequential becomes `self.head[1:](tp_copy(self.head[0](h)))`, so
        collectives and split implementations can sit between its layers; state dict keys do not change."""
        if len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star:
            raise UserError(f"`{code(call.func)}` is an nn.Sequential whose layers need rewriting; it must be "
                            "called with one positional input", span.start)
        expr = call.args[0].value
        count = len(self.ctx.containers[span])
        for run in self._runs(span):
            if len(run) == 1:
                layer = call.func
                for name in run[0]:
                    if not (name.isdigit() or name.isidentifier()):
                        raise UserError(f"cannot name layer {name!r} of `{code(call.func)}` in source", span.start)
                    layer = (cst.Subscript(layer, [cst.SubscriptElement(cst.Index(cst.Integer(name)))])
                             if name.isdigit() else cst.Attribute(layer, cst.Name(name)))
            else:
                first, last = int(run[0][0]), int(run[-1][0]) + 1
                layer = cst.parse_expression(f"{code(call.func)}[{first or ''}:{last if last < count else ''}]")
            expr = cst.Call(layer, [cst.Arg(expr)])
            for via in run:
                child = dataclasses.replace(span, via=via)
                self.ctx.visited.add(child)
                for concern in self.concerns:
                    expr = concern.leave(child, expr)
        self.ctx.note(span, f"{code(call.func)} (nn.Sequential) cut where its layers need collectives")
        return expr

    leave_Call = leave_Comparison = leave_BooleanOperation = leave_AugAssign = _leave_expr

    def leave_IndentedBlock(self, original, updated):
        return self.regions.leave_block(self._span(original), updated)

    def leave_FunctionDef(self, original, updated):
        return self.stages.leave_function(self._span(original), updated)

    def leave_For(self, original, updated):
        return self.stages.leave_for(self._span(original), updated)

    def leave_Attribute(self, original, updated):
        if isinstance(updated.value, cst.BinaryOperation):     # (a + b).view(...) keeps its parentheses
            return updated.with_changes(value=parenthesized(updated.value))
        factor = self.ctx.edits.full_sizes.get(self._span(original)) if self.ctx.edits is not None else None
        if factor:          # a split module's size attribute is local: its readers expect the full size
            self.ctx.note(self._span(original), f"{code(original)} is local: times {factor} for the full size")
            return parenthesized(cst.BinaryOperation(updated, cst.Multiply(), cst.Integer(str(factor))))
        return updated

    # A `reduced + bias` sum put where a call was must keep the user's precedence. The user's own
    # tree never holds an unparenthesized sum in these places, so only inserted sums are touched.
    @staticmethod
    def _bare_sum(expr) -> bool:
        return isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add) and not expr.lpar

    def leave_UnaryOperation(self, original, updated):
        updated = self._leave_expr(original, updated)
        if not isinstance(updated, cst.UnaryOperation):
            return updated
        if self._bare_sum(updated.expression) and not isinstance(updated.operator, cst.Not):
            return updated.with_changes(expression=parenthesized(updated.expression))
        return updated

    def leave_BinaryOperation(self, original, updated):
        updated = self._leave_expr(original, updated)
        if not isinstance(updated, cst.BinaryOperation) or isinstance(updated.operator, _LOOSER_THAN_ADD):
            return updated
        if self._bare_sum(updated.right):
            updated = updated.with_changes(right=parenthesized(updated.right))
        if self._bare_sum(updated.left) and not isinstance(updated.operator, (cst.Add, cst.Subtract)):
            updated = updated.with_changes(left=parenthesized(updated.left))
        return updated

    def leave_Subscript(self, original, updated):
        if self._bare_sum(updated.value):
            updated = updated.with_changes(value=parenthesized(updated.value))
        return self._leave_expr(original, updated)

    def leave_Assign(self, original, updated):
        targets = [self._span(t.target) for t in original.targets]
        steps = next((self.ctx.assigned.pop(t) for t in targets if t in self.ctx.assigned), None)
        if steps is None:
            return self._value_first(updated)
        if len(targets) > 1:
            raise UserError("cannot convert the value of a chained assignment for one of its targets",
                            targets[0].start, hint="assign each target on its own line")
        value = updated.value
        for step in steps:
            value = collective(step, value, AXIS)
            self.ctx.use(targets[0], step)
        return self._value_first(updated.with_changes(value=value))

    def _value_first(self, assign: cst.Assign) -> cst.Assign:
        """`x[i] = f(x[i])` whose x is converted and rebound on a line before, for the write: f reads
        x as the plan has it, before that conversion, so the value is computed first (as Python
        computes it before the write) into a name of its own, and that name is written."""
        rebound = {line.body[0].targets[0].target.value for line in self.ctx.before
                   if isinstance(line.body[0], cst.Assign) and isinstance(line.body[0].targets[0].target, cst.Name)}
        read = _names_in(assign.value)
        if not rebound & read:
            return assign
        if self.taken is None:
            self.taken = _names_in(self.module)
        stem = "_".join(sorted(rebound & read)) + "_written"
        name = next(n for n in (stem, *(f"{stem}{k}" for k in range(2, 100))) if n not in self.taken)
        self.taken.add(name)
        self.ctx.before.insert(0, cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(name))],
                                                                      assign.value)]))
        self.ctx.value_first = True
        return assign.with_changes(value=cst.Name(name))

    def leave_SimpleStatementLine(self, original, updated):
        before, self.ctx.before = self.ctx.before, []
        after, self.ctx.after = self.ctx.after, []
        if self.ctx.value_first:        # the statement's conversions went to its value's own line
            self.ctx.value_first = False
            before[0] = self._comment(original, before[0].with_changes(leading_lines=updated.leading_lines))
            updated = updated.with_changes(leading_lines=[])
        else:
            updated = self._comment(original, updated)
        return cst.FlattenSentinel([*before, updated, *after]) if before or after else updated

    def _comment(self, original, updated):
        span = self._span(original)
        fragments = [text for s, texts in self.ctx.notes.items() if span.contains(s) for text in texts]
        if not fragments:
            return updated
        comment = "# " + "; ".join(dict.fromkeys(fragments))
        trailing = updated.trailing_whitespace
        if trailing.comment is not None:
            comment = f"{trailing.comment.value} | {comment[2:]}"
        return updated.with_changes(trailing_whitespace=trailing.with_changes(
            whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(comment)))


def rewrite_module(source: SourceFile, edits: Edits, split: StageSplit | None = None,
                   containers: dict[Span, list[tuple[str, ...]]] | None = None,
                   recompute: dict[Span, tuple[str, ...]] | None = None, chain: tuple[StageSplit, ...] = (),
                   in_program: bool = True, mixed: frozenset = frozenset(),
                   unsliceable: frozenset = frozenset(), grouped: tuple[MethodGroups, ...] = ()
                   ) -> tuple[cst.Module, Context]:
    """`grouped`: the methods whose instances are planned per group (plan/instances.py); those of
    this file are rewritten per group, as variant classes (emit/variants.py): the Context holds
    them, for the caller to write after their class (insert_variants; a mirror keeps the file's
    top-level statements as they are)."""
    def once(edits: Edits, layers: dict | None = None) -> tuple[cst.Module, Context]:
        own = {**(containers or {}), **(layers or {})}   # a variant's nn.Sequential calls run its own layers
        return _rewrite_once(source, edits, split, own, recompute, chain, in_program, mixed, unsliceable)

    mine = [m for m in grouped if m.method.path == str(source.path)]
    return with_variants(source.module, edits, mine, once) if mine else once(edits)


def _rewrite_once(source: SourceFile, edits: Edits, split: StageSplit | None,
                  containers: dict[Span, list[tuple[str, ...]]] | None, recompute: dict[Span, tuple[str, ...]] | None,
                  chain: tuple[StageSplit, ...], in_program: bool, mixed: frozenset,
                  unsliceable: frozenset) -> tuple[cst.Module, Context]:
    ctx = Context(edits, split if split is not None and split.function.path == str(source.path) else None,
                  chain=tuple(c for c in chain if c.function.path == str(source.path)),
                  containers=containers or {}, mixed=frozenset(mixed), unsliceable=frozenset(unsliceable),
                  recompute=recompute or {}, in_program=in_program)
    wrapper = MetadataWrapper(source.module)
    module = wrapper.visit(FileRewriter(source, ctx))
    path = str(source.path)
    missed = [span for span, site in edits.sites.items() if span.path == path and span not in ctx.visited and (
        site.result or site.args or site.sizes or site.replace)]
    missed += [span for span in edits.ctors if span.path == path and span not in ctx.visited]
    if missed:
        raise UserError("the rewrite found no node for a planned edit here (please report it)", min(missed).start)
    return module, ctx
