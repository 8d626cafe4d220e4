"""Where a view's, expand's or split's sizes are written in the source, so a split dim can be made local."""
from __future__ import annotations

import libcst as cst

from ..graph.graph import Graph
from ..trace.records import Node

# Calls whose positional arguments after the tensor are the output sizes.
SIZE_ARGUMENTS = {"Tensor.view", "Tensor.reshape", "torch.reshape", "Tensor.expand"}
SPLIT_SIZES = {"Tensor.split", "torch.split"}


def locate_size_argument(graph: Graph, node: Node, dim: int) -> tuple | None | str:
    """Where the size of output `dim` is written in a view/reshape call: (argument path, tuple
    item), None when it is -1 (nothing to rewrite), or why it cannot be rewritten."""
    shape = graph.trace.tensors[node.outputs[0]].shape
    sizes = [op for op in node.operands if op.name.startswith("arg") and op.name != "arg0"]
    if len(sizes) == 1 and isinstance(sizes[0].value, tuple):
        values, paths = list(sizes[0].value), [(sizes[0].path, i) for i in range(len(shape))]
    else:
        values, paths = [op.value for op in sizes], [(op.path, None) for op in sizes]
    if len(values) != len(shape):
        return f"cannot tell which argument of {node.callee} sets dim {dim}"
    if values[dim] == -1:
        return None
    path, item = paths[dim]
    call = graph.source_node(node)
    if not isinstance(call, cst.Call) or path[0] != "pos":
        return f"cannot find the size argument of {node.callee}"
    from_end = len(values) - dim       # after a `*lead`, sizes are found by their place from the end
    if item is None:
        positional = [a for a in call.args if a.keyword is None]
        written = _written_at(positional, path[1], from_end, lambda a: bool(a.star))
        if written is None:
            return f"the size of dim {dim} is inside *args"
        # the emitter counts positional arguments without the starred ones
        return (path[0], written - sum(1 for a in positional[:written] if a.star)), None
    if path[1] >= len(call.args):
        return f"cannot find the size argument of {node.callee}"
    value = call.args[path[1]].value
    if isinstance(value, (cst.Tuple, cst.List)):
        written = _written_at(list(value.elements), item, from_end, lambda e: isinstance(e, cst.StarredElement))
        if written is not None:
            return path, written
    return f"the size of split dim {dim} comes from `{cst.Module([]).code_for_node(value)}`, which the " \
           "rewrite cannot make local"


def _written_at(items: list, at: int, from_end: int, starred) -> int | None:
    """Where in the source's items the size at runtime position `at` is written: at `at` when no
    starred item comes before it, else `from_end` from the end when no starred item comes after."""
    if at < len(items) and not any(starred(i) for i in items[:at + 1]):
        return at
    last_star = max((k for k, i in enumerate(items) if starred(i)), default=-1)
    if from_end <= len(items) - 1 - last_star:
        return len(items) - from_end
    return None


# ---- a parameter made by a tensor factory in the model file: nn.Parameter(torch.ones(n)) -----------
# torch.<name>(*sizes) or (sizes), and tensor.new_<name>(...); `full` takes its sizes first, then the value
FACTORIES = {"ones", "zeros", "empty", "randn", "rand", "full"}
LEGACY = {"Tensor", "FloatTensor", "DoubleTensor"}    # torch.Tensor(a, b): sizes; torch.Tensor([..]): values
# methods and nn.init functions that give back a tensor of the shape they were given
SHAPE_KEEPING = {"uniform_", "normal_", "fill_", "zero_", "exponential_", "clamp_", "clamp", "float", "double",
                 "half", "bfloat16", "to", "type", "mul", "mul_", "add", "add_", "sub", "sub_", "div", "div_",
                 "clone", "detach", "requires_grad_", "contiguous", "abs", "exp", "log", "sqrt", "neg", "cpu"}


def parameter_data(call: cst.Call) -> cst.Arg | None:
    """The argument holding nn.Parameter's tensor: the first positional one, or `data=`."""
    return next((a for a in call.args if a.keyword is None and not a.star), None) or next(
        (a for a in call.args if a.keyword is not None and a.keyword.value == "data"), None)


def factory_size(parameter: cst.Call, dim: int, rank: int | None,
                 shape_names: frozenset[str] = frozenset()) -> cst.BaseExpression | str:
    """The expression that sets dim `dim` of a parameter made by `nn.Parameter(<factory>)`:
    `n` in `torch.ones(n)`, `scale * torch.ones(n)`, `torch.ones(n) * scale`, `torch.full((n,), v)`,
    `torch.randn(a, n) * std`, `torch.empty(n).uniform_()`, `nn.Parameter(data=torch.zeros(size=(n,)))`;
    or why it cannot be found. `rank`: the parameter's number of dims (None: not checked);
    `shape_names`: names known to hold a whole shape, not one size (`shape = (n,)`)."""
    data = parameter_data(parameter)
    if data is None:
        return "the parameter's tensor is not passed to nn.Parameter"
    made = _factories(data.value)
    if not made:
        return f"`{_code(data.value)}` calls no tensor factory (torch.ones, torch.zeros, torch.full, ...) " \
               "whose sizes the rewrite can make local"
    if len(made) > 1:
        return f"`{_code(data.value)}` makes the tensor from more than one factory call"
    factory = made[0]
    if _last_name(factory.func) in LEGACY and any(isinstance(a.value, (cst.Tuple, cst.List)) for a in factory.args):
        return f"`{_code(factory)}` holds values, not sizes"
    full = _last_name(factory.func).removeprefix("new_") == "full"
    keyword = next((a for a in factory.args if a.keyword is not None and a.keyword.value == "size"), None)
    positional = [a for a in factory.args if a.keyword is None and a.star != "**"]   # **kwargs: dtype, device
    if full:
        positional = positional[:1]
    if keyword is not None:
        positional = [keyword]
    if any(a.star for a in positional):
        return f"the sizes of `{_code(factory)}` are inside *args"
    items = [a.value for a in positional]
    if len(items) == 1 and isinstance(items[0], (cst.Tuple, cst.List)):
        elements = items[0].elements
        if any(isinstance(e, cst.StarredElement) for e in elements):
            return f"the sizes of `{_code(factory)}` are inside *args"
        items = [e.value for e in elements]
    elif len(items) == 1 and (full or keyword is not None or _dotted(items[0]) in shape_names):
        return f"the sizes of `{_code(factory)}` come from `{_code(items[0])}`, a whole shape"
    if rank is not None and len(items) != rank:
        return f"cannot tell which size of `{_code(factory)}` sets dim {dim} of a {rank}-dim parameter"
    if not -len(items) <= dim < len(items):
        return f"`{_code(factory)}` has no size for dim {dim}"
    return items[dim]


def _factories(expr: cst.BaseExpression) -> list[cst.Call]:
    """The factory calls whose result the expression keeps the shape of."""
    if isinstance(expr, cst.BinaryOperation):
        return _factories(expr.left) + _factories(expr.right)
    if isinstance(expr, cst.UnaryOperation):
        return _factories(expr.expression)
    if not isinstance(expr, cst.Call):
        return []
    func, name = expr.func, _last_name(expr.func)
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Call):      # torch.empty(n).uniform_()
        return _factories(func.value) if name in SHAPE_KEEPING else []
    if name in FACTORIES | LEGACY and (isinstance(func, cst.Name) or _dotted(func).startswith("torch.")) or (
            name.startswith("new_") and name[4:] in FACTORIES):
        return [expr]
    if "init." in _dotted(func) or _dotted(func).startswith("init."):         # nn.init.trunc_normal_(torch.zeros(n))
        first = next((a for a in expr.args if a.keyword is None and not a.star), None)
        return _factories(first.value) if first is not None else []
    return []


def _last_name(func: cst.BaseExpression) -> str:
    return func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else ""


def _dotted(expr: cst.BaseExpression) -> str:
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        inner = _dotted(expr.value)
        return f"{inner}.{expr.attr.value}" if inner else ""
    return ""


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def shape_names(function: cst.FunctionDef | None) -> frozenset[str]:
    """Names the function binds to a whole shape: `shape = (n, m)`, `= [n]`, `= x.shape`, `= x.size()`."""
    if function is None:
        return frozenset()
    out = set()

    class Visit(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            value = node.value
            whole = isinstance(value, (cst.Tuple, cst.List)) or (
                isinstance(value, cst.Attribute) and value.attr.value == "shape") or (
                isinstance(value, cst.Call) and _last_name(value.func) in ("size", "Size", "tuple", "list"))
            if whole:
                out.update(_dotted(t.target) for t in node.targets if _dotted(t.target))

    function.visit(Visit())
    return frozenset(out)


def dims_sized_by_read(graph: Graph, node: Node, read_span, read_rank: int, dim: int | None) -> dict[int, int]:
    """The output dims of a view or expand whose size the source takes from a size read at
    `read_span` of a tensor of rank `read_rank`: read dim -> output dim. `x.size()` as the only
    size (`mask.expand(x.size())`), `*x.size()` with no starred size before it
    (`y.expand(*x.size(), n)`), or `x.size(d)` as one size (`y.view(x.size(0), -1)`)."""
    call = graph.source_node(node)
    if not isinstance(call, cst.Call) or graph.sources is None or not node.outputs:
        return {}
    source = graph.sources.get(node.span.path)
    rank = len(graph.trace.tensors[node.outputs[0]].shape)
    # (expression, starred) of each size argument, or of each item of a sizes tuple
    positional = [(a.value, bool(a.star)) for a in call.args if a.keyword is None]
    positional = positional[1:] if node.callee == "torch.reshape" else positional
    if len(positional) == 1 and isinstance(positional[0][0], (cst.Tuple, cst.List)):
        positional = [(e.value, isinstance(e, cst.StarredElement)) for e in positional[0][0].elements]
    for at, (argument, starred) in enumerate(positional):
        if not source.span_of(argument).contains(read_span) or any(s for _, s in positional[:at]):
            continue
        if dim is None and starred and at + read_rank <= rank:
            return {d: at + d for d in range(read_rank)}
        if dim is None and not starred and len(positional) == 1 and read_rank == rank:   # the whole shape
            return {d: d for d in range(rank)}
        if dim is not None and not starred:
            return {dim % read_rank: at}
    return {}


def expand_broadcasts(graph: Graph, node: Node, dim: int) -> bool:
    """An expand's output dim comes from a dim of size 1 of its input, or is added in front:
    its size may be anything, whole or local, and the input still fits."""
    tensor = next((op.tid for op in node.operands if op.name == "arg0"), None)
    if node.callee != "Tensor.expand" or tensor is None:
        return False
    shape_in = graph.trace.tensors[tensor].shape
    lead = len(graph.trace.tensors[node.outputs[0]].shape) - len(shape_in)
    return dim < lead or shape_in[dim - lead] == 1
