"""Op semantics derived from torch itself: a numeric probe of one traced call.

For a call no rule in rules/ops describes, the probe calls it again on small real tensors of
the traced shapes (see trace/replay.py): whole, and with its tensor operands sliced in two
along candidate dims. A set of operand dims is a split label when the two half results,
concatenated along one output dim (or summed: a partial sum), equal the whole result. An
operand whose values never change the result (`x.new_zeros(...)`, `torch.zeros_like(x)`,
a mask helper reading only `x.shape`) is read for its shape only and is no data input.

Sliced operands run on fake tensors before real ones, so that no CPU kernel that trusts its
operands' shapes (weight norm's) is fed halves that do not fit together: such a slicing is no
split. What the probe cannot see it does not claim: a dim no slicing test passes on stays whole.
The probe derives; it decides no plan. Results are cached per (callee, shapes, arguments),
so the repeated blocks of a deep model probe once. A call too large to probe at its traced
shape is probed at a small shape of itself (same ranks and dtypes, its large dims divided by one
factor): a label names operand dims and result positions, not sizes, so it holds at every size.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import math
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

from ..trace.records import Node, TensorList, Trace
from ..trace.replay import Replay, TensorRef, substitute
from ..trace.tracer import quiet_fake_mode
from .dims import Factor, OpDims, TensorDims

# Calls on tensors larger than these are not probed at their traced shape (production shapes) but
# at a small shape of themselves (at_small_shape), whose labels they keep. The probe's time and memory grow with the activations (a call's intermediates and results are
# sized by them: AlphaFold's pair tensors at 8M elements make GBs inside one call), less with the
# weights it reads: a weight may be 16M elements (64 MiB of fp32), so that a tiny model's bank of
# hundreds of experts (BailingHybrid's 512 x 256 x 64 = 8.4M) is probed and split, while
# production weights (Llama-7B's 4096 x 11008) stay over it.
MAX_PROBE_ELEMENTS = 1 << 22
MAX_PROBE_PARAM_ELEMENTS = 1 << 24
_MAX_COMBINATIONS = 32


@dataclass
class Derived:
    dims: OpDims | None
    problem: str | None


class _CannotReplay(Exception):
    pass


def derive(node: Node, trace: Trace, cache: dict, size_attributes=None) -> Derived:
    """`size_attributes(module type)`: per parameter and dim, the names of the layer's
    attributes holding that size (RuleSet.size_attributes); a probe slicing a layer's weight
    sets them to the local size, as the rewrite's divided constructor argument does."""
    names = _operand_names(node)
    if all(not trace.tensors[tid].shape for tid in [*names, *node.outputs]):
        # scalars in and out (a cache's counters): no dim to split, so it runs whole, exactly
        return Derived(OpDims({name: TensorDims(tid, []) for tid, own in names.items() for name in own},
                              [TensorDims(tid, []) for tid in node.outputs]), None)
    replay = trace.replays.get(node.index)
    if replay is None or replay.outputs is None:
        return Derived(None, "no rule, and the call cannot be replayed to derive one")
    key = _signature(node, trace, replay)
    if key not in cache:
        with _filled_uninitialized_memory():
            sizes = size_attributes(node.callee) if size_attributes is not None and replay.module is not None else {}
            cache[key] = _probe(node, trace, replay, sizes)
    found = cache[key]
    if isinstance(found, str):
        return Derived(None, found)
    dims = _to_dims(found, node, trace, replay)
    return Derived(dims, None if dims is not None else "no rule, and its results could not be matched to the trace")


@contextlib.contextmanager
def _filled_uninitialized_memory():
    """`x.new_empty(...)`, `torch.empty_like(x)`: results a call leaves uninitialized are filled
    with a known value (NaN, the largest integer) instead of whatever the memory held, so that
    calls compare equal and an operand read for its shape only is seen as such."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    _use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # "... does not have a deterministic implementation"
            yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        _use_deterministic_algorithms(enabled, warn_only=warn_only)


def _use_deterministic_algorithms(mode: bool, *, warn_only: bool):
    """torch.use_deterministic_algorithms also sets the flag in inductor's config, importing the
    compiler for it (a second). Nothing compiles here: while inductor is not loaded, set the
    dispatcher's flag alone (inductor reads its own default when it loads)."""
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


def _signature(node: Node, trace: Trace, replay: Replay):
    parts = [node.callee, type(replay.fn).__name__]
    for operand in node.operands:
        if operand.tid is not None:
            info = trace.tensors[operand.tid]
            parts.append((operand.name, info.shape, info.dtype))
        elif isinstance(operand.value, TensorList):
            parts.append((operand.name, tuple((trace.tensors[t].shape, trace.tensors[t].dtype) for t in operand.value)))
        else:
            parts.append((operand.name, repr(operand.value)))
    parts.append(tuple(trace.tensors[t].shape for t in replay.outputs))
    return tuple(parts)


# ---- real tensors of the traced shapes ----------------------------------------------------
def _real(shape: tuple[int, ...], dtype_name: str, generator: torch.Generator, index_range: int = 0) -> torch.Tensor:
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=generator)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) < 0.5
    if not shape:
        return torch.tensor(1, dtype=dtype)
    # Integers are often indices (token ids, positions): keep them inside the last dim's range,
    # and different per row so that an op mixing rows is seen.
    last = index_range or max(shape[-1], 2)
    rows = torch.arange(max(1, _numel(shape) // max(shape[-1], 1))).reshape(*shape[:-1], 1)
    offset = int(torch.randint(1, last, (), generator=generator))
    return ((torch.arange(shape[-1]) + rows * offset + offset) % last).to(dtype)


def _other_values(tensor: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
    """Tensors of the same shape whose values differ from `tensor`'s. For integers two: every
    element shifted within the range seen, and all of one value. A row of indices holding each
    of 0..k-1 once is shifted into another such row, which an op reading the indices as a set
    (`scatter_(1, topk_indices, 1)`) cannot tell apart; a constant row it can."""
    if tensor.is_floating_point() or tensor.is_complex():
        return [tensor + 1 + torch.rand(tensor.shape, generator=generator).to(tensor.dtype)]
    if tensor.dtype == torch.bool:
        return [~tensor]
    modulus = max(int(tensor.max()) + 1 if tensor.numel() else 2, 2)
    shifted = ((tensor + 1) % modulus).to(tensor.dtype)
    constant = torch.full_like(tensor, 0 if tensor.numel() and bool((tensor != 0).any()) else 1)
    return [shifted, constant]


def too_large_to_probe(trace: Trace, tids) -> bool:
    """A probe on these tensors would allocate them for real: not at production shapes."""
    return any(_numel(trace.tensors[t].shape) > (MAX_PROBE_ELEMENTS if trace.tensors[t].param is None
                                                 else MAX_PROBE_PARAM_ELEMENTS) for t in tids)


class AtSmallShape:
    """The trace as one call reads it at a small shape of itself: the call's tensors with their
    large dims divided by one factor (same ranks, dtypes, and ratios between sizes), its integer
    arguments that named such a size divided alike. A split label is a fact about which operand
    dims the call keeps apart, found by slicing them in two: the same at any size of the call."""

    def __init__(self, trace: Trace, replay: Replay, shapes: dict[int, tuple[int, ...]]):
        self.traced, self.ops = trace, trace.ops
        self.tensors = collections.ChainMap(
            {tid: dataclasses.replace(trace.tensors[tid], shape=shape, stride=None) for tid, shape in shapes.items()},
            trace.tensors)
        self.replay = replay


# A large dim is divided down to this many or more (a fused q|k|v dim stays 3 blocks of an even size);
# the largest sizes are divided until every tensor of the call is this small.
SMALL_PROBE_SIZE = 4
SMALL_PROBE_ELEMENTS = 1 << 16
# small shapes tried past the first that runs, for one whose divided dims can also be halved
LARGER_SMALL_SHAPES = 8


def at_small_shape(trace: Trace, replay: Replay, tids: list[int], size_attributes=None) -> AtSmallShape | None:
    """A small shape of this call small enough to probe, where it runs (on fake tensors) with
    results of the traced ranks and dtypes; None when none is found. Sizes only the activations
    have (batch, sequence, heads) are divided first, the largest first; a layer's weights only
    when that is not enough. Of those, the first whose divided dims the call also runs halved
    (_halves_run), else the first that runs."""
    shapes = {tid: trace.tensors[tid].shape for tid in tids}
    in_weights = {s for tid in tids if trace.tensors[tid].param is not None for s in shapes[tid]}
    large = sorted({s for shape in shapes.values() for s in shape if s >= 2 * SMALL_PROBE_SIZE and s % 2 == 0},
                   reverse=True)
    traced_results = [(tuple(trace.tensors[t].shape), trace.tensors[t].dtype) for t in replay.outputs]
    first, tries = None, 0
    for divisible in ([s for s in large if s not in in_weights], large):
        for shapes_small, renamed in _divided(shapes, divisible, trace):
            for call_replay in (replay, _with_sizes(replay, renamed)):
                view = AtSmallShape(trace, call_replay, shapes_small)
                caller = _Caller(view, call_replay, tids, size_attributes=size_attributes)
                results = caller.fake_results()
                if not isinstance(results, str) and len(results) == len(traced_results) and all(
                        len(shape) == len(want) and str(dtype) == want_dtype and all(
                            n == w or n == renamed.get(w) or (0 < n < w) for n, w in zip(shape, want))
                        for (shape, dtype), (want, want_dtype) in zip(results, traced_results)):
                    if _halves_run(caller, shapes, renamed):
                        return view
                    first, tries = first or view, tries + 1
                    if tries > LARGER_SMALL_SHAPES:
                        return first
    return first


def _halves_run(caller: _Caller, traced: dict[int, tuple[int, ...]], renamed: dict[int, int]) -> bool:
    """Whether the call still runs, on fake tensors, with each divided size halved in every
    operand dim it divided: a kernel with a minimum size or alignment (`torch._grouped_mm` wants
    strides of a multiple of 16 bytes: 8 bfloat16) runs whole at the small shape but not on its
    halves, and the probe would find no split of that dim, which the traced shape has."""
    for size in renamed:
        halved = dict(caller.base)
        for tid, t in caller.base.items():
            for dim, traced_size in enumerate(traced[tid]):
                if traced_size == size:
                    halved[tid] = halved[tid].narrow(dim, 0, t.shape[dim] // 2)
        # laid out as the probe calls them: cloned, so dense
        if isinstance(caller.fake_results({tid: t.clone() for tid, t in halved.items()}), str):
            return False
    return True


def _divided(shapes: dict[int, tuple[int, ...]], divisible: list[int], trace: Trace):
    """(shapes, {size: divided size}) with the fewest of the largest sizes divided (by one
    factor) that brings every tensor to SMALL_PROBE_ELEMENTS; failing that, the smallest
    shapes within the probe's limits."""
    fallback = []
    for k in range(1, len(divisible) + 1):
        chosen = divisible[:k]
        # the largest factor first; smaller ones after it, for kernels that refuse the smallest
        # shapes (`torch._grouped_mm` wants rows of a multiple of 16 bytes: 4 bfloat16 are 8)
        for n, factor in enumerate(_common_factors(chosen)):
            small = {tid: tuple(s // factor if s in chosen else s for s in shape) for tid, shape in shapes.items()}
            renamed = {s: s // factor for s in chosen}
            if all(_numel(shape) <= SMALL_PROBE_ELEMENTS for shape in small.values()):
                yield small, renamed
            elif n == 0 and not any(_numel(shape) > (MAX_PROBE_ELEMENTS if trace.tensors[tid].param is None
                                                     else MAX_PROBE_PARAM_ELEMENTS) for tid, shape in small.items()):
                fallback.append((small, renamed))
    yield from fallback[-1:]


def _common_factors(sizes: list[int]) -> list[int]:
    """The factors > 1 dividing every size to an even quotient of at least SMALL_PROBE_SIZE,
    largest first."""
    if not sizes:
        return []
    g = math.gcd(*sizes) // 2          # a factor of it leaves every quotient even
    divisors = {k for d in range(1, math.isqrt(g) + 1) if g % d == 0 for k in (d, g // d)}
    smallest = min(sizes)
    return sorted((d for d in divisors if d > 1 and smallest // d >= SMALL_PROBE_SIZE), reverse=True)


def _with_sizes(replay: Replay, renamed: dict[int, int]) -> Replay:
    """The replay with integer arguments that equal a divided size divided alike
    (`self._shape(tensor, seq_len, bsz)`)."""
    def walk(value):
        if type(value) is int and value in renamed:
            return renamed[value]
        if type(value) in (tuple, list):
            return type(value)(walk(v) for v in value)
        if type(value) is dict:
            return {k: walk(v) for k, v in value.items()}
        return value
    return dataclasses.replace(replay, args=walk(replay.args), kwargs=walk(replay.kwargs))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def with_strides(value: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """`value` laid out in memory with `stride` (a traced tensor's), when that is a dense order
    of its elements (a transposed view reshaped); as it is otherwise. A call reading memory
    itself (`x.as_strided(x.size(), x.stride())`) reads the elements in the traced order."""
    if stride is None or len(stride) != value.dim() or not _dense(tuple(value.shape), stride):
        return value
    out = torch.empty_strided(tuple(value.shape), stride, dtype=value.dtype)
    out.copy_(value)
    return out


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Every element of `shape` at its own offset, with no gaps: a permutation of the dims'
    contiguous strides."""
    expected = 1
    for size, step in sorted(((s, t) for s, t in zip(shape, stride) if s != 1), key=lambda p: p[1]):
        if step != expected:
            return False
        expected *= size
    return True


class _Caller:
    """Calls the replay with real tensors; `override` replaces some of them. `strided`: the real
    tensors have the traced strides (see with_strides)."""

    def __init__(self, trace: Trace, replay: Replay, tids: list[int], strided: bool = False,
                 size_attributes: dict[str, list[set[str]]] | None = None):
        self.replay, self.trace, self.tids, self.strided = replay, trace, tids, strided
        self.size_attributes = size_attributes or {}
        self.generator = torch.Generator().manual_seed(0)
        self.base = self._values()
        self._runs_fake: bool | None = None     # see _check_shapes

    def _values(self, index_range: int = 0) -> dict[int, torch.Tensor]:
        values = {tid: _real(self.trace.tensors[tid].shape, self.trace.tensors[tid].dtype, self.generator, index_range)
                  for tid in self.tids}
        if self.strided:
            values = {tid: with_strides(v, getattr(self.trace.tensors[tid], "stride", None)) for tid, v in values.items()}
        return values

    def widened(self) -> _Caller | None:
        """The same call with its float32 tensors in float64 (`whole`: its results), made once;
        None where it cannot run so."""
        if "_wide" not in self.__dict__:
            wide = copy.copy(self)
            wide.base = {tid: t.double() if t.dtype == torch.float32 else t for tid, t in self.base.items()}
            try:
                wide.whole = wide()
            except _CannotReplay:
                wide = None
            self._wide = wide
        return self._wide

    def narrow_indices(self) -> None:
        """Integers in {0, 1} only: for calls whose integer operands index something smaller than
        the last dim (class labels, a few experts)."""
        self.base = self._values(index_range=2)

    def __call__(self, override: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        tensors = {tid: t.clone() for tid, t in self.base.items()}
        tensors.update({tid: t.clone() for tid, t in (override or {}).items()})
        if any(t.shape != self.base[tid].shape for tid, t in (override or {}).items()):
            self._check_shapes(tensors)
        try:
            result = self._run(tensors)
        except Exception as exc:   # any failure means "this slicing is not a valid split"
            raise _CannotReplay(f"{type(exc).__name__}: {exc}") from None
        flat = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if len(flat) != len(self.replay.outputs):
            raise _CannotReplay("the call returned other results than in the trace")
        if any(isinstance(t, FakeTensor) for t in flat):
            # a module holding a tensor the fake trace made (a cached bias): no values to compare
            raise _CannotReplay("the call read a tensor of the fake-tensor trace")
        return flat

    def _run(self, tensors: dict[int, torch.Tensor]):
        args, kwargs = substitute(self.replay.args, tensors), substitute(self.replay.kwargs, tensors)
        torch.manual_seed(0)
        # a recurrent layer runs torch's own kernels, not oneDNN's: oneDNN's inference LSTM and
        # GRU take seconds per call on some CPUs, and a probe replays a call hundreds of times.
        # Every other call keeps oneDNN, whose depthwise convolutions are many times faster.
        with torch.no_grad(), torch.backends.mkldnn.flags(enabled=not self.replay.recurrent):
            module = self.replay.module
            if module is None:
                return self.replay.fn(*args, **kwargs)
            state = {name: tensors[tid] for name, tid in self.replay.state.items()}
            # the layer's attributes hold the traced sizes, also while it runs at a small shape
            traced = self.trace.traced if isinstance(self.trace, AtSmallShape) else self.trace
            with _local_sizes(module, self.size_attributes, state, traced, self.replay.state):
                return torch.func.functional_call(module, state, args, kwargs, strict=False)

    def _check_shapes(self, tensors: dict[int, torch.Tensor]) -> None:
        """Sliced operands run on fake tensors before real ones: some of torch's CPU kernels do
        not check their operands' shapes (the weight-norm kernel, given a `g` sliced apart from
        its `v`, writes past its buffer and the process aborts), while the fake kernels check
        every shape. A call that fake tensors cannot run even whole is not checked."""
        if self._runs_fake is None:
            self._runs_fake = self._fake_run(self.base) is None
        if not self._runs_fake:
            return
        problem = self._fake_run(tensors)
        if problem is not None:
            raise _CannotReplay(f"the sliced shapes do not fit together ({problem})")

    def _fake_run(self, tensors: dict[int, torch.Tensor]) -> str | None:
        """The failure of the call on fake tensors of these shapes; None when it runs."""
        found = self.fake_results(tensors)
        return found if isinstance(found, str) else None

    def fake_results(self, tensors: dict[int, torch.Tensor] | None = None) -> list[tuple[torch.Size, torch.dtype]] | str:
        """(shape, dtype) of each tensor result of the call on fake tensors of these shapes (the
        base values' by default), or why it failed. Attributes the call sets on its module (a
        cache) are put back: they would hold fake tensors."""
        modules = list(self.replay.module.modules()) if self.replay.module is not None else []
        saved = [dict(vars(m)) for m in modules]
        try:
            with quiet_fake_mode(small_constants=False):
                # made in the mode, not converted (FakeTensorMode.from_tensor imports the compiler)
                result = self._run({tid: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                                    for tid, t in (self.base if tensors is None else tensors).items()})
                return [(t.shape, t.dtype) for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}".split("\n")[0]
        finally:
            for module, attributes in zip(modules, saved):
                vars(module).clear()
                vars(module).update(attributes)


@contextlib.contextmanager
def _local_sizes(module, size_attributes: dict[str, list[set[str]]], state: dict, trace: Trace, tids: dict[str, int]):
    """While a sliced weight runs through its layer: the layer's attributes holding a sliced
    dim's size (`self.out_channels`) hold the slice's size, as in a layer built with that
    constructor argument divided."""
    saved = {}
    try:
        for param, per_dim in size_attributes.items():
            value = state.get(param)
            if value is None or param not in tids:
                continue
            full = trace.tensors[tids[param]].shape
            for d, names in enumerate(per_dim[:len(full)]):
                if value.dim() != len(full) or value.shape[d] == full[d]:
                    continue
                for name in names:
                    held = module.__dict__.get(name)
                    if type(held) is int and held == full[d] and name not in saved:
                        saved[name] = held
                        module.__dict__[name] = int(value.shape[d])
        yield
    finally:
        module.__dict__.update(saved)


# ---- the probe ----------------------------------------------------------------------------
@dataclass
class _Label:
    # (operand name, dim, groups) of operands split together: the dim as `groups` blocks, each
    # halved (a fused gate|up weight is 2 blocks, split alike)
    members: list[tuple[str, int, int]]
    outputs: dict[int, int]                 # result position -> the dim it splits on
    reduced: bool


@dataclass
class _Probed:
    """What one probe found, by operand name and result position: the same for every
    invocation with the same signature."""

    labels: list[_Label]
    shape_only: set[str]
    free: dict[str, set[int]] = field(default_factory=dict)   # see OpDims.free


def _operand_names(node: Node) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for operand in node.operands:
        if operand.tid is not None:
            names.setdefault(operand.tid, []).append(operand.name)
        elif isinstance(operand.value, TensorList):
            for k, tid in enumerate(operand.value):
                names.setdefault(tid, []).append(f"{operand.name}[{k}]")
    return names


def _probe(node: Node, trace: Trace, replay: Replay, size_attributes=None) -> _Probed | str:
    names = _operand_names(node)
    # An operand no torch call inside reads (only its .shape or .dtype) is no data input.
    read = {tid for index in node.ops for tid in trace.ops[index].inputs}
    shape_only = {name for tid, own in names.items() if tid not in read for name in own}
    # a call that returns no tensor (create_causal_mask when attention needs no mask) depends
    # on no dim of its operands
    unprobed = _Probed([], shape_only, {name: set(range(len(trace.tensors[tid].shape)))
                                        for tid, own in names.items() for name in own if name in shape_only}
                       if not replay.outputs else {})
    tids = sorted({*_refs(replay.args), *_refs(replay.kwargs), *replay.state.values()})
    if too_large_to_probe(trace, tids):
        small = at_small_shape(trace, replay, tids, size_attributes)
        if small is None:
            return unprobed if shape_only else "no rule, and its tensors are too large to probe, also at a small shape"
        # the same call with its dims shrunk: what it finds there (by operand, dim and result) holds here
        trace, replay = small, small.replay
    call = _Caller(trace, replay, tids, size_attributes=size_attributes)
    try:
        whole = call()
    except _CannotReplay:
        call.narrow_indices()
        try:
            whole = call()
        except _CannotReplay as exc:
            return unprobed if shape_only else f"no rule, and replaying it failed ({exc})"
    params = set(replay.state.values())
    data = []
    for tid in names:
        if tid in params or tid not in call.base or names[tid][0] in shape_only:
            continue
        try:
            same = all(_all_equal(call({tid: fresh}), whole)
                       for fresh in _other_values(call.base[tid], call.generator))
        except _CannotReplay:
            same = False
        if same:
            shape_only.update(names[tid])
        else:
            data.append(tid)
    free = _free_dims(call, trace, whole, names, shape_only, params)
    taken: set[tuple[int, int]] = set()
    labels = []
    # operands read for their shape whose shape the result follows (`key[..., :n].copy_(k)`,
    # `torch.zeros_like(x) + y`) are sliced with the data when slicing the data alone cannot work
    sized = [tid for tid in names if tid in call.base and tid not in params and tid not in data]
    # a module's own weights, split with its operands (the hidden dim of a custom projection) or
    # on their own (an expert bank's intermediate dim: the results are partial sums)
    weights = [tid for tid in names if tid in params and tid in call.base and trace.tensors[tid].param is not None]

    def found_label(found) -> None:
        members, outputs, reduced = found
        taken.update((t, d) for t, d, _ in members)
        labels.append(_Label([(name, d, g) for t, d, g in members for name in names[t]], outputs, reduced))

    for tid in data:
        for dim, size in enumerate(trace.tensors[tid].shape):
            if size < 2 or size % 2 or (tid, dim) in taken:
                continue
            found = _find_label(call, trace, whole, data, tid, dim, taken) or \
                (_find_label(call, trace, whole, data + sized, tid, dim, taken) if sized else None) or \
                (_find_label(call, trace, whole, data + weights, tid, dim, taken) if weights else None)
            if found is not None:
                found_label(found)
    for tid in weights:
        for dim, size in enumerate(trace.tensors[tid].shape):
            for groups in (1, 2, 3):
                if (tid, dim) in taken or size % (2 * groups) or size // groups < 2:
                    continue
                found = _find_label(call, trace, whole, data + weights, tid, dim, taken, groups)
                if found is not None:
                    found_label(found)
    return _Probed(labels, shape_only, free)


def _free_dims(call, trace: Trace, whole, names: dict[int, list[str]], shape_only: set[str],
               params: set[int]) -> dict[str, set[int]]:
    """Per shape-only operand, the dims it may have half of with the same results."""
    free: dict[str, set[int]] = {}
    for tid, own in names.items():
        if tid in params or tid not in call.base or own[0] not in shape_only:
            continue
        for dim, size in enumerate(trace.tensors[tid].shape):
            if size < 2 or size % 2:
                continue
            try:
                same = _all_equal(call({tid: call.base[tid].narrow(dim, 0, size // 2)}), whole)
            except _CannotReplay:
                same = False
            if same:
                for name in own:
                    free.setdefault(name, set()).add(dim)
    return free


def _refs(value) -> list[int]:
    if isinstance(value, TensorRef):
        return [value.tid]
    if type(value) in (tuple, list):
        return [t for v in value for t in _refs(v)]
    if type(value) is dict:
        return [t for v in value.values() for t in _refs(v)]
    return []


def _find_label(call: _Caller, trace: Trace, whole, data, tid, dim, taken, groups: int = 1):
    """(members, result dims, reduced) of the first slicing of `tid` along `dim`, with
    same-sized dims of the other operands, whose halves rebuild the whole result. `groups` > 1:
    `tid`'s dim is that many blocks, each halved, and partners' dims may be blocks too."""
    size = trace.tensors[tid].shape[dim] // groups
    partners = []
    for other in data:
        if other == tid:
            continue
        options = [(other, d, g) for d, s in enumerate(trace.tensors[other].shape) if (other, d) not in taken
                   for g in ((1, 2, 3) if groups > 1 else (1,)) if s == g * size]
        partners.append(options + [None])
    combos = sorted(itertools.islice(itertools.product(*partners), _MAX_COMBINATIONS),
                    key=lambda c: -sum(p is not None for p in c))
    for combo in combos:
        members = [(tid, dim, groups), *(p for p in combo if p is not None)]
        found = _test_split(call, whole, members)
        if found is not None:
            return members, *found
    return None


def _half(value: torch.Tensor, dim: int, groups: int, k: int) -> torch.Tensor:
    """The k-th half of `dim`, or of each of its `groups` blocks."""
    if groups == 1:
        half = value.shape[dim] // 2
        return value.narrow(dim, k * half, half)
    blocks = value.unflatten(dim, (groups, value.shape[dim] // groups))
    half = blocks.shape[dim + 1] // 2
    return blocks.narrow(dim + 1, k * half, half).flatten(dim, dim + 1)


def _test_split(call: _Caller, whole, members) -> tuple[dict[int, int], bool] | None:
    try:
        pieces = [call({t: _half(call.base[t], d, g, k) for t, d, g in members}) for k in (0, 1)]
    except _CannotReplay:
        return None
    found = _split_meaning(pieces, whole, _close)
    if found is None and _split_meaning(pieces, whole, _roughly_close) is not None:
        # close but for float32 rounding that the halves' batch size changes (a recurrence over
        # many steps amplifies the last bits of each GEMM): asked again in float64
        wide = call.widened()
        if wide is not None:
            try:
                pieces = [wide({t: _half(wide.base[t], d, g, k) for t, d, g in members}) for k in (0, 1)]
            except _CannotReplay:
                return None
            found = _split_meaning(pieces, wide.whole, _close)
    return found


def _split_meaning(pieces, whole, close) -> tuple[dict[int, int], bool] | None:
    """(result position -> the dim its halves join on, whether the results are partial sums) of
    the two halves' results, equal to the whole results under `close`; None when they are not."""
    outputs, summed = {}, False
    for position, full in enumerate(whole):
        first, second = pieces[0][position], pieces[1][position]
        if first.shape == full.shape and second.shape == full.shape:
            if _equal(first, full) and _equal(second, full):
                continue                        # this result does not depend on the split
            if full.is_floating_point() and (close(first + second, full) or _close_to_scale(first + second, full)):
                summed = True
                continue
            return None
        out_dim = next((d for d in range(full.dim()) if _halves_of(first, second, full, d, close)), None)
        if out_dim is None:
            return None
        outputs[position] = out_dim
    if bool(outputs) == summed:     # nothing depends on the split, or no single meaning
        return None
    return outputs, summed


def _halves_of(first: torch.Tensor, second: torch.Tensor, full: torch.Tensor, dim: int, close=None) -> bool:
    expected = list(full.shape)
    expected[dim] = full.shape[dim] // 2
    return list(first.shape) == expected and list(second.shape) == expected and \
        (close or _close)(torch.cat([first, second], dim), full)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a filled uninitialized result)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return (a.is_floating_point() or a.is_complex()) and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _all_equal(xs, ys) -> bool:
    return len(xs) == len(ys) and all(_equal(x, y) for x, y in zip(xs, ys))


def _close_to_scale(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to rounding of a reordered sum: within 1e-5 of the largest value (a partial sum
    over 60 experts of random weights loses the last digits of small entries); in a narrower
    float, within its own rounding (_narrow_rounding)."""
    if a.shape != b.shape or a.dtype != b.dtype or not b.numel():
        return False
    narrow = _narrow_rounding(b.dtype)
    scale = max(_largest(a), _largest(b)) if narrow else _largest(b)
    return bool(((a - b).abs().nan_to_num(0.0) <= (narrow or 1e-5) * scale + 1e-6).all()) and bool(
        torch.equal(a.isnan(), b.isnan()))


def _largest(t: torch.Tensor) -> float:
    return t.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max().item() if t.numel() else 0.0


def _narrow_rounding(dtype: torch.dtype) -> float | None:
    """For a float narrower than float32 (bfloat16, float16), the distance from the largest value
    within which two results of the same computation are equal; None for other dtypes, whose
    fixed tolerances hold. A call computing in bfloat16 (an expert bank's `_grouped_mm` in
    bfloat16) rounds each half's result to it (half an eps of values up to the largest), their
    sum once more and the whole result once: within 2 eps of the largest value. 4 eps allows for
    halves larger than their sum; a wrong split misses by a sizeable part of the values (random
    operands), tens of eps."""
    if not dtype.is_floating_point or torch.finfo(dtype).eps <= torch.finfo(torch.float32).eps:
        return None
    return 4 * torch.finfo(dtype).eps


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    if _narrow_rounding(a.dtype):
        return _close_to_scale(a, b)
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))


def _roughly_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within a hundredth of the largest value: float32 rounding (a GRU over 16 steps drifts 2e-3),
    or another computation, which float64 then tells apart."""
    if a.shape != b.shape or a.dtype != b.dtype or not (a.is_floating_point() and a.dtype == torch.float32):
        return False
    scale = b.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max().item()
    return bool(((a - b).abs().nan_to_num(0.0) <= 1e-2 * scale).all()) and bool(torch.equal(a.isnan(), b.isnan()))


# ---- one invocation's labels --------------------------------------------------------------
def _to_dims(probed: _Probed, node: Node, trace: Trace, replay: Replay) -> OpDims | None:
    """The probe's labels in this invocation's tensor ids (None when a result the graph
    uses is not among the call's results)."""
    at: dict[tuple[str, int], tuple[str, int]] = {}
    out_at: dict[tuple[int, int], tuple[str, int]] = {}
    reduced = set()
    for k, label in enumerate(probed.labels):
        name = f"p{k}"
        at.update({(member, d): (name, g) for member, d, g in label.members})
        out_at.update({(position, dim): (name, 1) for position, dim in label.outputs.items()})
        if label.reduced:
            reduced.add(name)

    def dims_of(shape, key):
        """A labelled dim is one factor, or (groups, label): the label split in every block."""
        out = []
        for d, s in enumerate(shape):
            found = key(d)
            if not found:
                out.append(())
            else:
                label, groups = found
                out.append((Factor(label, s),) if groups == 1 else (Factor(str(groups), groups),
                                                                    Factor(label, s // groups)))
        return out

    inputs = {}
    operand_names = _operand_names(node)
    for tid, names in operand_names.items():
        shape = trace.tensors[tid].shape
        for name in names:
            if name not in probed.shape_only:
                inputs[name] = TensorDims(tid, dims_of(shape, lambda d: at.get((name, d))))
    outputs = []
    for tid in node.outputs:
        if tid not in replay.outputs:
            operand = handed_back(tid, node, trace, operand_names)
            if operand is None:
                return None
            name = operand_names[operand][0]
            outputs.append(TensorDims(tid, dims_of(trace.tensors[tid].shape, lambda d: at.get((name, d)))))
            continue
        position = replay.outputs.index(tid)
        outputs.append(TensorDims(tid, dims_of(trace.tensors[tid].shape, lambda d: out_at.get((position, d)))))
    return OpDims(inputs, outputs, reduced=reduced, shape_only=set(probed.shape_only),
                  free={name: set(dims) for name, dims in probed.free.items()})


def handed_back(tid: int, node: Node, trace: Trace, operand_names: dict[int, list[str]]) -> int | None:
    """The operand a result of the call is the very object of: ops inside handed that
    operand back unmodified (`position_bias.contiguous()` of a contiguous tensor, which the next
    layer reads), so the result is split as the operand is. None for any other result."""
    produced_by = {out: trace.ops[i] for i in node.ops for out in trace.ops[i].outputs}
    while tid not in operand_names:
        op = produced_by.get(tid)
        if op is None or not op.returns_input or len(op.inputs) != 1:
            return None
        tid = op.inputs[0]
    return tid
