"""Dimension labels computed from an op's arguments and shapes, for ops whose split rule is
structural (elementwise broadcasting, view/reshape, transpose, split, cat, slicing, reductions).

Each function takes the shapes and argument values of one invocation and returns OpDims.
"""
from __future__ import annotations

from typing import Any, Callable

from ..trace.records import UNKNOWN
from .dims import Annotation, DimsError, Factor, OpDims, TensorDims, bind

Shapes = dict[str, tuple[int, ...]]


class Call:
    """One invocation as the kinds see it: tensor operands, plain arguments, outputs."""

    def __init__(self, shapes: Shapes, tids: dict[str, int], values: dict[str, Any],
                 out_shapes: list[tuple[int, ...]], out_tids: list[int], lists: dict[str, list[int]]):
        self.shapes, self.tids, self.values = shapes, tids, values
        self.out_shapes, self.out_tids, self.lists = out_shapes, out_tids, lists

    def arg(self, *names, default=None):
        for name in names:
            if name in self.values:
                return self.values[name]
        return default

    def first_tensor(self) -> str:
        if "arg0" in self.shapes:
            return "arg0"
        if not self.shapes:
            raise DimsError("no tensor operand")
        return next(iter(self.shapes))


def _norm(dim: int, rank: int) -> int:
    if not isinstance(dim, int):
        raise DimsError(f"dim {dim!r} is not an int")
    return dim + rank if dim < 0 else dim


def _labelled(shape, prefix="d") -> list[tuple[Factor, ...]]:
    return [(Factor(f"{prefix}{i}", s),) if s != 1 else () for i, s in enumerate(shape)]


def elementwise(call: Call, fixed_arg: tuple[str, ...] = (), fixed_last: int = 0) -> OpDims:
    """Broadcasting op: output dims labelled d0.., inputs aligned to the right."""
    rank = max([len(s) for s in [*call.shapes.values(), *call.out_shapes]] or [0])
    out_shape = call.out_shapes[0] if call.out_shapes else ()
    full = [1] * (rank - len(out_shape)) + list(out_shape)
    labels = [f"d{i}" for i in range(rank)]
    fixed = set(labels[rank - fixed_last:]) if fixed_last else set()
    if fixed_arg:
        dim = call.arg(*fixed_arg)
        if dim is not None:
            for d in (dim if isinstance(dim, (tuple, list)) else (dim,)):
                fixed.add(labels[_norm(d, rank)])

    def dims_of(shape):
        offset = rank - len(shape)
        return [(Factor(labels[offset + i], s),) if s != 1 and s == full[offset + i] else ()
                for i, s in enumerate(shape)]

    inputs = {n: TensorDims(call.tids[n], dims_of(s)) for n, s in call.shapes.items()}
    for name, tids in call.lists.items():
        inputs.update({f"{name}[{i}]": TensorDims(t, []) for i, t in enumerate(tids)})
    outputs = [TensorDims(t, dims_of(s) if len(s) <= rank else _labelled(s, "o"))
               for t, s in zip(call.out_tids, call.out_shapes)]
    return OpDims(inputs, outputs, fixed=fixed)


def replicate(call: Call) -> OpDims:
    """No dim may be split: the op runs whole on every device (factories, masks, ...)."""
    inputs = {n: TensorDims(call.tids[n], []) for n in call.shapes}
    return OpDims(inputs, [TensorDims(t, []) for t in call.out_tids])


def reshape(call: Call) -> OpDims:
    """view/reshape/flatten/unsqueeze/squeeze: match dims by products of sizes.

    One input dim becoming several output dims (C -> heads, head_dim) splits on the first
    of them only, so that each shard stays contiguous; likewise several becoming one.
    """
    name = call.first_tensor()
    src, dst = call.shapes[name], call.out_shapes[0]
    in_dims: list[tuple[Factor, ...]] = [() for _ in src]
    out_dims: list[tuple[Factor, ...]] = [() for _ in dst]
    fixed: set[str] = set()
    i = j = 0
    counter = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            raise DimsError(f"cannot align {src} with {dst}")
        gi, gj = [i], [j]
        a, b = src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(src):
                    raise DimsError(f"cannot align {src} with {dst}")
                gi.append(i)
                a *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    raise DimsError(f"cannot align {src} with {dst}")
                gj.append(j)
                b *= dst[j]
        many = gi if len(gi) > 1 else gj
        if len(gi) > 1 and len(gj) > 1:
            for k in gi:
                in_dims[k] = (Factor(f"x{counter}_{k}", src[k]),)
                fixed.add(f"x{counter}_{k}")
            for k in gj:
                out_dims[k] = (Factor(f"y{counter}_{k}", dst[k]),)
                fixed.add(f"y{counter}_{k}")
            # the outermost dims still line up when one's size divides the other's: (B, S, X) ->
            # (-1, k) keeps the batch as the outer part of the merged dim, so a slice of it stays one
            outer, first_in, first_out = min(src[gi[0]], dst[gj[0]]), src[gi[0]], dst[gj[0]]
            if max(first_in, first_out) % outer == 0:
                lead = Factor(f"r{counter}_lead", outer)
                rest = Factor(f"r{counter}_rest", max(first_in, first_out) // outer)
                fixed.add(rest.label)
                in_dims[gi[0]] = (lead,) if first_in == outer else (lead, rest)
                out_dims[gj[0]] = (lead,) if first_out == outer else (lead, rest)
        else:
            sizes = src if many is gi else dst
            factors = []
            for n, k in enumerate(x for x in many if sizes[x] != 1):
                label = f"r{counter}_{n}"
                factors.append(Factor(label, sizes[k]))
            single = gj[0] if many is gi else gi[0]
            if many is gi:
                for f, k in zip(factors, [x for x in gi if src[x] != 1]):
                    in_dims[k] = (f,)
                out_dims[single] = tuple(factors)
            else:
                for f, k in zip(factors, [x for x in gj if dst[x] != 1]):
                    out_dims[k] = (f,)
                in_dims[single] = tuple(factors)
        counter += 1
        i += 1
        j += 1
    inputs = {name: TensorDims(call.tids[name], in_dims)}
    # view_as / reshape_as: the other tensor's shape is the result's, so it is split as the result is
    for other in (n for n in call.shapes if n != name and call.shapes[n] == dst):
        inputs[other] = TensorDims(call.tids[other], out_dims)
    return OpDims(inputs, [TensorDims(call.out_tids[0], out_dims)], fixed=fixed)


def transpose(call: Call) -> OpDims:
    name = call.first_tensor()
    src = call.shapes[name]
    rank = len(src)
    order = list(range(rank))
    func_dims = call.arg("arg1", "dim0"), call.arg("arg2", "dim1")
    if func_dims[0] is None:                       # .T / .mT / .t()
        func_dims = (-2, -1) if rank >= 2 else (0, 0)
    a, b = (_norm(d, rank) for d in func_dims)
    order[a], order[b] = order[b], order[a]
    return _permuted(call, name, order)


def permute(call: Call) -> OpDims:
    name = call.first_tensor()
    rank = len(call.shapes[name])
    dims = call.arg("arg1", "dims")
    if isinstance(dims, int):
        dims = [call.arg(f"arg{i}") for i in range(1, rank + 1)]
    return _permuted(call, name, [_norm(d, rank) for d in dims])


def _permuted(call: Call, name: str, order: list[int]) -> OpDims:
    in_dims = _labelled(call.shapes[name])
    out_dims = [in_dims[k] for k in order]
    return OpDims({name: TensorDims(call.tids[name], in_dims)}, [TensorDims(call.out_tids[0], out_dims)])


def split(call: Call) -> OpDims:
    """split/chunk into equal pieces: the dim is (pieces, c) and each output has c."""
    name = call.first_tensor()
    src = call.shapes[name]
    dim = _norm(call.arg("arg2", "dim", default=0), len(src))
    sizes = {s[dim] for s in call.out_shapes}
    in_dims = _labelled(src)
    outs = [_labelled(s) for s in call.out_shapes]
    if len(sizes) == 1 and len(call.out_shapes) > 1:
        piece = sizes.pop()
        in_dims[dim] = (Factor(str(len(call.out_shapes)), len(call.out_shapes)), Factor("c", piece))
        for out in outs:
            out[dim] = (Factor("c", piece),)
    else:
        for out, shape in zip(outs, call.out_shapes):
            out[dim] = (Factor(f"p{id(out)}", shape[dim]),)
        in_dims[dim] = (Factor("whole", src[dim]),)
    op = OpDims({name: TensorDims(call.tids[name], in_dims)},
                [TensorDims(t, d) for t, d in zip(call.out_tids, outs)])
    op.fixed |= {f.label for f in in_dims[dim] if f.label == "whole"} | {
        f.label for out in outs for f in out[dim] if f.label.startswith("p")}
    return op


def unbind(call: Call) -> OpDims:
    """unbind(dim): each output is the input without `dim`; the other dims keep their labels."""
    name = call.first_tensor()
    src = call.shapes[name]
    dim = _norm(call.arg("arg1", "dim", default=0), len(src))
    in_dims = _labelled(src)
    outs = [in_dims[:dim] + in_dims[dim + 1:] for _ in call.out_tids]
    in_dims[dim] = (Factor(str(src[dim]), src[dim]),) if src[dim] > 1 else ()
    return OpDims({name: TensorDims(call.tids[name], in_dims)},
                  [TensorDims(t, list(d)) for t, d in zip(call.out_tids, outs)])


def cat(call: Call, new_dim: bool = False) -> OpDims:
    """cat/stack of equal pieces along dim: the output dim is (pieces, c)."""
    name = next(iter(call.lists), None)
    if name is None:
        raise DimsError("no tensor list operand")
    tids = call.lists[name]
    shapes = call.values.get(f"{name}.shapes")
    out = call.out_shapes[0]
    dim = _norm(call.arg("arg1", "dim", default=0), len(out))
    in_shape = shapes[0]
    labels = _labelled(out)
    if not new_dim and len({s[dim] for s in shapes}) == 1:
        labels[dim] = (Factor(str(len(tids)), len(tids)), Factor("c", in_shape[dim]))
        in_dims = [list(labels[:dim]) + [(Factor("c", in_shape[dim]),)] + list(labels[dim + 1:])]
    elif new_dim:
        labels[dim] = (Factor(str(len(tids)), len(tids)),) if len(tids) > 1 else ()
        in_dims = [list(labels[:dim]) + list(labels[dim + 1:])]
    else:
        labels[dim] = (Factor("whole", out[dim]),)
        in_dims = [list(labels[:dim]) + [(Factor(f"part{k}", s[dim]),)] + list(labels[dim + 1:])
                   for k, s in enumerate(shapes)]
    inputs = {f"{name}[{k}]": TensorDims(t, list(in_dims[min(k, len(in_dims) - 1)]))
              for k, t in enumerate(tids)}
    for n in call.shapes:
        inputs[n] = TensorDims(call.tids[n], [])
    op = OpDims(inputs, [TensorDims(call.out_tids[0], labels)])
    op.fixed |= {"whole"} | {f"part{k}" for k in range(len(tids))}
    return op


def _indexed(call: Call) -> tuple[str, list[tuple[Factor, ...]], list[tuple[Factor, ...]], set[str]]:
    """x[index] with slices, ints, None and ...: (name of x, dims of x, dims of x[index], labels
    the index fixes). A full slice keeps a dim's label; a partial slice or an int fixes it."""
    name = call.first_tensor()
    src = call.shapes[name]
    index = call.arg("arg1")
    index = index if isinstance(index, tuple) else (index,)
    if "arg1" not in call.values or any(ix is UNKNOWN or isinstance(ix, str) for ix in index):
        raise DimsError("indexing with tensors or unknown values")
    in_dims = _labelled(src)
    selected: list[tuple[Factor, ...]] = []
    fixed: set[str] = set()
    explicit = sum(1 for ix in index if ix is not None and ix is not Ellipsis)
    d = 0
    for ix in index:
        if ix is Ellipsis:
            selected += in_dims[d:d + len(src) - explicit]
            d += len(src) - explicit
        elif ix is None:
            selected.append(())
        elif isinstance(ix, slice):
            step = ix.step if isinstance(ix.step, int) else 1
            start = ix.start or 0
            if start == 0 and ix.stop is None and step == 1:
                selected.append(in_dims[d])
            elif isinstance(start, int) and 0 <= start < step and ix.stop is None and src[d] % step == 0:
                # every step-th element from one of the first step (gpt-oss's interleaved gate and
                # linear halves, `x[..., ::2]`, `x[..., 1::2]`): x split in pieces of whole steps
                # gives each device its piece of the result
                label = in_dims[d][0].label
                in_dims[d] = (Factor(label, src[d] // step), Factor(str(step), step))
                selected.append((Factor(label, src[d] // step),))
            else:
                fixed |= {f.label for f in in_dims[d]}
                selected.append(())
            d += 1
        elif isinstance(ix, int):
            fixed |= {f.label for f in in_dims[d]}
            d += 1
        else:
            raise DimsError(f"unsupported index {ix!r}")
    return name, in_dims, selected + in_dims[d:], fixed


def getitem(call: Call) -> OpDims:
    """`x[index]`: the result has the dims the index keeps."""
    name, in_dims, out_dims, fixed = _indexed(call)
    out_shape = call.out_shapes[0]
    if len(out_dims) != len(out_shape):
        raise DimsError(f"index {call.arg('arg1')!r} does not match the output rank")
    out_dims = [f if f and f[0].size == s else () for f, s in zip(out_dims, out_shape)]
    return OpDims({name: TensorDims(call.tids[name], in_dims)}, [TensorDims(call.out_tids[0], out_dims)],
                  fixed=fixed)


def setitem(call: Call) -> OpDims:
    """`x[index] = value`: the result is x, labelled as x; `value` broadcasts against x[index],
    so a value dim as long as a dim the index keeps shares its label."""
    name, in_dims, selected, fixed = _indexed(call)
    inputs = {name: TensorDims(call.tids[name], in_dims)}
    if "arg2" in call.shapes:
        shape = call.shapes["arg2"]
        if len(shape) > len(selected):
            raise DimsError(f"a value of shape {shape} does not fit x[{call.arg('arg1')!r}]")
        aligned = selected[len(selected) - len(shape):]
        inputs["arg2"] = TensorDims(call.tids["arg2"], [labels if labels and labels[0].size == size else ()
                                                        for labels, size in zip(aligned, shape)])
    for other in call.shapes:
        inputs.setdefault(other, TensorDims(call.tids[other], []))
    return OpDims(inputs, [TensorDims(call.out_tids[0], list(in_dims))], fixed=fixed)


def expand(call: Call) -> OpDims:
    """expand(sizes): the batch (dim 0, when the call keeps it) may be split, so data parallelism
    and micro-batches pass through `x[:, :, None].expand(b, s, rep, d)`; other dims stay whole.
    (Its sizes are often read from the input's shape, already local, or from the config, not:
    splitting them would need to tell the two apart.)"""
    name = call.first_tensor()
    src, dst = call.shapes[name], call.out_shapes[0]
    in_dims = [dims if k == 0 else () for k, dims in enumerate(_labelled(src))]
    keeps_batch = len(src) == len(dst) and src and src[0] == dst[0]
    out_dims = [in_dims[0] if k == 0 and keeps_batch else () for k in range(len(dst))]
    if not keeps_batch:
        in_dims = [() for _ in src]
    return OpDims({name: TensorDims(call.tids[name], in_dims)}, [TensorDims(call.out_tids[0], out_dims)])


def complex_view(call: Call) -> OpDims:
    """view_as_complex drops a last dim of 2 (real, imaginary); view_as_real adds one. Only the
    batch (dim 0) may be split: letting heads split through rotary embeddings made the z3
    search take minutes (Meta's llama), and a tensor-parallel plan gathers around it instead."""
    name = call.first_tensor()
    src, dst = call.shapes[name], call.out_shapes[0]
    in_dims = _labelled(src)
    if len(dst) == len(src) - 1:
        out_dims = in_dims[:-1]
        in_dims[-1] = ()
    else:
        out_dims = in_dims + [()]
    fixed = {f.label for dims in in_dims[1:] for f in dims}
    return OpDims({name: TensorDims(call.tids[name], in_dims)}, [TensorDims(call.out_tids[0], out_dims)],
                  fixed=fixed)


def reduce(call: Call, summing: bool) -> OpDims:
    """sum/mean/max over dims: a summed dim splits into partial sums; others must stay whole."""
    name = call.first_tensor()
    src = call.shapes[name]
    in_dims = _labelled(src)
    dims = call.arg("arg1", "dim")
    if dims is None:
        reduced = list(range(len(src)))
    else:
        reduced = [_norm(d, len(src)) for d in (dims if isinstance(dims, (tuple, list)) else (dims,))]
    keepdim = bool(call.arg("arg2", "keepdim", default=False))
    out_dims = [() if k in reduced else in_dims[k] for k in range(len(src)) if keepdim or k not in reduced]
    labels = {f.label for k in reduced for f in in_dims[k]}
    # max/min over a dim return (values, indices), both of the reduced shape
    outputs = [TensorDims(t, out_dims) for t, shape in zip(call.out_tids, call.out_shapes) if len(shape) == len(out_dims)]
    op = OpDims({name: TensorDims(call.tids[name], in_dims)}, outputs or [TensorDims(call.out_tids[0], out_dims)])
    if summing:
        op.reduced |= labels
    else:
        op.fixed |= labels
    return op


def passthrough(call: Call) -> OpDims:
    """Output i is tensor input i (caches, several casts): equal shapes split together."""
    names = list(call.shapes)
    inputs, outputs = {}, []
    for k, (tid, shape) in enumerate(zip(call.out_tids, call.out_shapes)):
        if k < len(names) and call.shapes[names[k]] == shape:
            dims = _labelled(shape, f"s{'x'.join(map(str, shape))}_")
            inputs[names[k]] = TensorDims(call.tids[names[k]], dims)
            outputs.append(TensorDims(tid, dims))
        else:
            outputs.append(TensorDims(tid, []))
    labelled = {dims.tid: dims for dims in inputs.values()}
    for n in names:     # one tensor passed twice (`cache.update(kv, kv)`, one result): labelled alike
        inputs.setdefault(n, labelled.get(call.tids[n], TensorDims(call.tids[n], [])))
    return OpDims(inputs, outputs, feeds={n: {k} if k < len(outputs) else set() for k, n in enumerate(names)})


def einsum(call: Call) -> OpDims:
    """torch.einsum("bhqd,bhkd->bhqk", ...): letters missing from the output are summed."""
    equation = call.arg("arg0", "equation")
    if not isinstance(equation, str) or "->" not in equation or "..." in equation:
        raise DimsError("einsum needs an explicit equation without ...")
    lhs, rhs = equation.replace(" ", "").split("->")
    operands = [(n, call.tids[n], call.shapes[n]) for n in call.shapes]
    if not operands and len(call.lists) == 1:       # the operands as one tuple: einsum(eq, (a, b))
        name, tids = next(iter(call.lists.items()))
        operands = [(f"{name}[{k}]", t, shape) for k, (t, shape) in enumerate(zip(tids, call.values[f"{name}.shapes"]))]
    parts = lhs.split(",")
    if len(parts) != len(operands):
        raise DimsError("einsum operand count mismatch")
    inputs = {n: TensorDims(tid, [(Factor(c, s),) for c, s in zip(p, shape)])
              for (n, tid, shape), p in zip(operands, parts)}
    out = TensorDims(call.out_tids[0], [(Factor(c, s),) for c, s in zip(rhs, call.out_shapes[0])])
    return OpDims(inputs, [out], reduced=set(lhs.replace(",", "")) - set(rhs))


# F.multi_head_attention_forward (nn.MultiheadAttention's forward) on (L, N, E) inputs: `h` the
# heads, `d` a head's size inside each projection's rows (q|k|v fused in in_proj_weight), so
# that a split by heads keeps whole heads; the out-projection's columns are the heads too.
_MHA = ("arg0|query: l^ b e^, arg1|key: s^ b k^, arg2|value: s^ b v^, arg5|in_proj_weight?: (3 h d^) e^, "
        "arg6|in_proj_bias?: (3 h d^), arg7|bias_k?: o^ p^ (h d^), arg8|bias_v?: o^ p^ (h d^), "
        "arg11|out_proj_weight: e^ (h d^), arg12|out_proj_bias?: e^, key_padding_mask?: b s^, attn_mask?: l^ s^, "
        "q_proj_weight?: (h d^) e^, k_proj_weight?: (h d^) k^, v_proj_weight?: (h d^) v^ -> l^ b e^")


def multi_head_attention(call: Call) -> OpDims:
    """Heads and batch of F.multi_head_attention_forward. The attention weights (need_weights=True)
    are a second result: averaged, whole over the heads; per head (N, H, L, S), split with them.
    A per-head (3-d) attn_mask and static keys or values are not described (the op stays whole)."""
    for name in ("static_k", "static_v"):
        if name in call.shapes:
            raise DimsError(f"{name} is not split by this rule")
    embed_dim, heads = call.arg("arg3", "embed_dim_to_check"), call.arg("arg4", "num_heads")
    if not isinstance(embed_dim, int) or not isinstance(heads, int) or heads <= 0 or embed_dim % heads:
        raise DimsError("embed_dim_to_check and num_heads are not known integers")
    text = _MHA
    if len(call.out_shapes) == 2:
        rank = len(call.out_shapes[1])
        if rank not in (3, 4):
            raise DimsError(f"attention weights of {rank} dims")
        text += ", b l^ t^" if rank == 3 else ", b h l^ t^"
    return bind(Annotation.parse(text), call.shapes, call.tids, call.out_shapes, call.out_tids,
                known={"d": embed_dim // heads})


def recurrent(call: Call) -> OpDims:
    """nn.RNN / nn.LSTM / nn.GRU called as a module (its parameters `self.weight_ih_l{k}[_reverse]`,
    ...): split by hidden units `u`. torch stacks the gates' rows gate-major ([i|f|g|o] x H for an
    LSTM, [r|z|n] for a GRU), so a rank's rows are `(G u)`, strided per gate, in every layer and
    direction; the gate count G is the rows of weight_hh_l0 over its columns. The input, the
    initial state and the results are whole on every rank: the split implementation gathers the
    hidden state at every step. A projected LSTM (proj_size, weight_hr_l*) and a packed sequence
    (no tensor input) are not described: the layer stays whole."""
    weights = {n: s for n, s in call.shapes.items() if n.startswith("self.")}
    if "arg0" not in call.shapes:
        raise DimsError("a packed sequence (or no tensor input) is not split by hidden units")
    if "self.weight_hh_l0" not in weights:
        raise DimsError("no weight_hh_l0: not a recurrent layer")
    if any(n.startswith("self.weight_hr_l") for n in weights):
        raise DimsError("proj_size: an LSTM with projections is not split by hidden units")
    rows, hidden = weights["self.weight_hh_l0"]
    if rows % hidden:
        raise DimsError(f"weight_hh_l0 of {rows} rows is no whole number of gates of {hidden} units")
    gates = rows // hidden
    rows_dims = (Factor(str(gates), gates), Factor("u", hidden)) if gates > 1 else (Factor("u", hidden),)
    shape = call.shapes["arg0"]
    if len(shape) not in (2, 3):
        raise DimsError(f"an input of {len(shape)} dims")
    # the steps and the batch: batch_first is the layer's setting (`self.batch_first`); 2-d: unbatched
    batch_first = call.arg("self.batch_first", default=False)
    steps, batch = (shape[0], 1) if len(shape) == 2 else (shape[1], shape[0]) if batch_first else shape[:2]
    layers = sum(1 for n in weights if n.startswith("self.weight_hh_l") and not n.endswith("_reverse"))
    runs = layers * (2 if "self.weight_hh_l0_reverse" in weights else 1)      # layers x directions
    # the batch `b` (data parallelism) where a tensor has one: the sequences at dim 0 (batch_first)
    # or 1, the states (layers x directions, batch, hidden) at dim 1
    sequence = (batch, steps) if batch_first else (steps, batch)
    b = Factor("b", batch)

    def batched(tid: int, dims: tuple[int, ...], state: bool) -> TensorDims:
        if len(shape) == 2 or batch == 1:
            return TensorDims(tid, [])
        at = 1 if state or not batch_first else 0
        return TensorDims(tid, [(b,) if d == at else () for d in range(len(dims))])

    inputs = {}
    for name, dims in call.shapes.items():
        if name in weights:
            if dims[0] != rows:
                raise DimsError(f"{name} of {dims[0]} rows, not the {rows} of weight_hh_l0")
            inputs[name] = TensorDims(call.tids[name], [rows_dims] + [()] * (len(dims) - 1))
        else:
            inputs[name] = batched(call.tids[name], dims, name != "arg0")
    for name, tids in call.lists.items():
        shapes = call.values[f"{name}.shapes"]
        inputs.update({f"{name}[{i}]": batched(t, s, True) for i, (t, s) in enumerate(zip(tids, shapes))})
    outputs = []
    for tid, dims in zip(call.out_tids, call.out_shapes):
        # the output sequence, or h_n / c_n: told apart by shape where they differ in their batch's place
        is_state = dims[:len(dims) - 1] == ((runs, batch) if len(shape) == 3 else (runs,))
        is_sequence = dims[:len(dims) - 1] == sequence[:len(dims) - 1]
        if is_state and is_sequence and batch_first and len(shape) == 3 and batch > 1:
            raise DimsError("the output sequence and the final state have one shape: which is which is unknown")
        outputs.append(batched(tid, dims, is_state))
    state = batch * hidden
    # per step, a rank's new units all-gathered (forward) and the gathered state's partial gradient
    # all-reduced (backward); an LSTM's last cell state gathered once per run; a layer above the
    # first all-reduces its input's gradient
    collectives = [("all_gather", state, steps * runs, False), ("all_reduce", state, (steps - 1) * runs, True)]
    if gates == 4:
        collectives.append(("all_gather", state, runs, False))
    if layers > 1:
        collectives.append(("all_reduce", steps * state * runs // layers, runs - runs // layers, True))
    # every weight matrix's rows (G u) times its columns, at every step of every sample
    flops = tuple((str(steps * batch * gates * s[1]), "u") for n, s in weights.items()
                  if n.startswith("self.weight_") and len(s) == 2)
    return OpDims(inputs, outputs, flops=flops, collectives=tuple(collectives))


# kinds that describe a layer holding weight matrices (not a structural op reading a table)
LAYER_KINDS = frozenset({"multi_head_attention", "recurrent"})

KINDS: dict[str, Callable[..., OpDims]] = {
    "elementwise": elementwise, "replicate": replicate, "reshape": reshape, "transpose": transpose,
    "permute": permute, "split": split, "unbind": unbind, "cat": cat, "stack": lambda c: cat(c, new_dim=True),
    "getitem": getitem, "setitem": setitem, "expand": expand, "complex_view": complex_view, "sum": lambda c: reduce(c, True), "reduce": lambda c: reduce(c, False),
    "passthrough": passthrough, "einsum": einsum, "multi_head_attention": multi_head_attention,
    "recurrent": recurrent,
}
