"""The analytical cost model: time per op on one device, and time per collective on one mesh axis.

An op is priced by what bounds it on a real device: a contraction (a label summed over that two
floating operands share: linear, matmul, conv, attention) by its FLOPs at the matmul rate of its
compute dtype, everything else by the bytes it reads and writes at the memory bandwidth; views
and ops that hand back an input move nothing. The optimizer step is priced per parameter. It
must not choose plans or know layer names: it prices what the trace recorded.

Times are seconds; the search scales them to integer nanoseconds for z3.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache

from ..graph.dims import OpDims
from ..trace.records import Node, Trace

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# Backward over forward. A contraction's backward is two contractions of the same size (the
# gradients of both operands). A memory-bound op's backward reads the output's gradient and
# what forward saved and writes one gradient: about 3 tensors where forward moved 2, so 1.5x
# (a binary add's backward only passes the gradient on; softmax, norms, gelu, dropout need 1.5x).
CONTRACTION_BACKWARD = 2.0
MEMORY_BOUND_BACKWARD = 1.5
# Default optimizer traffic when a spec gives no measured figure: AdamW reads parameter,
# gradient and two moments and writes parameter and two moments, 7 fp32 tensors.
ADAMW_BYTES_PER_PARAM = 28.0
# torch.autocast runs these in float32 whatever their inputs (the autocast op reference,
# "CUDA Ops that can autocast to float32"); a contraction runs in the lower precision; every
# other op runs in the widest floating type among its inputs.
AUTOCAST_FP32 = frozenset({
    "softmax", "log_softmax", "softmin", "layer_norm", "group_norm", "norm", "normalize", "cross_entropy",
    "nll_loss", "binary_cross_entropy_with_logits", "kl_div", "l1_loss", "mse_loss", "smooth_l1_loss",
    "exp", "expm1", "log", "log10", "log1p", "log2", "pow", "__pow__", "__rpow__", "rsqrt", "reciprocal",
    "sum", "prod", "cumsum", "cumprod", "softplus", "cosine_similarity", "cdist", "erfinv", "acos", "asin",
    "cosh", "sinh", "tan", "__rdiv__", "__rtruediv__", "renorm"})
_ELEMENT_BYTES = {"torch.float64": 8, "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2}
_HALF = {"bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class DeviceSpec:
    """One device, and the link one mesh axis communicates over.

    `matmul_rates` is FLOP/s per compute dtype; a missing dtype runs at `flops`.
    `memory_bandwidth` (bytes/s) prices every op that is not a contraction; by default
    4·flops, the old model's one element per FLOP. `precision` is the plan's compute dtype
    for contractions (None: the traced tensors' dtype; "tf32": fp32 matmuls on tensor cores;
    "bf16"/"fp16": autocast)."""

    name: str = "cpu-gloo"
    flops: float = 5e10              # sustained FLOP/s of one device
    memory: float = 8e9              # bytes per device
    bandwidth: float = 2e9           # bytes/s of the link an axis communicates over
    latency: float = 3e-5            # seconds per collective call
    matmul_rates: tuple[tuple[str, float], ...] = ()
    matmul_overhead: float = 0.0     # seconds each contraction costs beyond its FLOPs (small-matmul falloff)
    memory_bandwidth: float | None = None
    optimizer_seconds_per_param: float | None = None
    precision: str | None = None
    op_overhead: float = 0.0         # seconds any other op costs beyond its bytes (dispatch: CPU ranks)
    matmul_half_rows: float = 0.0    # a contraction whose result has r rows (or columns, the fewer) runs at
                                     # rate / (1 + matmul_half_rows / r): skinny matmuls reuse less

    def matmul_rate(self, dtype: str) -> float:
        return dict(self.matmul_rates).get(dtype, self.flops)

    @property
    def bytes_per_second(self) -> float:
        return self.memory_bandwidth if self.memory_bandwidth is not None else 4.0 * self.flops

    @property
    def seconds_per_param(self) -> float:
        if self.optimizer_seconds_per_param is not None:
            return self.optimizer_seconds_per_param
        return ADAMW_BYTES_PER_PARAM / self.bytes_per_second


@dataclass(frozen=True)
class ClusterSpec:
    """Devices of one kind in nodes; rules/devices/NAME.toml."""

    name: str
    flops: float
    memory: float
    devices_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    latency: float
    devices: int | None = None
    matmul_rates: tuple[tuple[str, float], ...] = ()
    matmul_overhead: float = 0.0
    memory_bandwidth: float | None = None
    optimizer_seconds_per_param: float | None = None
    precision: str | None = None
    op_overhead: float = 0.0
    matmul_half_rows: float = 0.0
    # whether communication runs beside compute (GPUs: NCCL on its own stream): the data-parallel
    # collectives the output issues from the backward's hooks then cost max(compute, them), not the sum
    overlap: bool = False

    def axis(self, stride: int, size: int) -> DeviceSpec:
        """The link an axis of `size` ranks, `stride` apart, talks over: inside a node or not."""
        inside = stride * size <= self.devices_per_node
        return DeviceSpec(self.name, self.flops, self.memory,
                          self.intra_bandwidth if inside else self.inter_bandwidth, self.latency,
                          self.matmul_rates, self.matmul_overhead, self.memory_bandwidth,
                          self.optimizer_seconds_per_param, self.precision, self.op_overhead,
                          self.matmul_half_rows)

    def with_precision(self, precision: str | None) -> "ClusterSpec":
        return replace(self, precision=precision)


def check_precision(precision: str | None) -> str | None:
    """`--precision`: one of PRECISIONS, or None for the traced dtypes."""
    if precision is not None and precision not in PRECISIONS:
        from ..errors import UserError
        raise UserError(f"--precision {precision}: unknown compute dtype",
                        hint="--precision fp32 | tf32 (fp32 matmuls on tensor cores) | bf16 | fp16 (autocast)")
    return precision


def load_cluster(name: str) -> ClusterSpec:
    import tomllib
    from ..errors import Location, UserError, display_path, toml_error
    from ..rules_path import find_rules_file, rules_files
    path = find_rules_file("devices", name)
    if path is None:
        known = ", ".join(p.stem for p in rules_files("devices"))
        raise UserError(f"unknown cluster {name!r}", hint=f"clusters: {known} (devices/NAME.toml in a rules folder)")
    text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise toml_error(exc, path, text) from None
    if "device" not in data or "cluster" not in data:
        missing = "[device]" if "device" not in data else "[cluster]"
        raise UserError(f"device spec {name!r} has no {missing} table", Location(display_path(path)),
                        hint="a device spec has [device] flops, memory and [cluster] devices_per_node, "
                        "intra_bandwidth, inter_bandwidth, latency (see rules/devices/cpu-gloo.toml)")
    lines = text.splitlines()

    def line_of(key: str, after: str | None = None) -> int:
        start = next((i for i, l in enumerate(lines) if after and l.strip() == f"[{after}]"), 0)
        return next((i + 1 for i, l in enumerate(lines) if i >= start and re.match(rf"\s*{key}\s*=", l)), 1)

    def number(table: dict, section: str, key: str, kind=float, required: bool = True, zero: bool = False):
        value = table.get(key)
        if value is None and not required:
            return None
        line = line_of(key, section)
        if value is None:
            raise UserError(f"device spec {name!r} has no `{key}` in [{section}]", Location(display_path(path), line),
                            hint="see rules/devices/cpu-gloo.toml for the keys a device spec needs")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero) \
                or (kind is int and value != int(value)):
            raise UserError(f"`{key} = {value!r}` in [{section}]: expected a "
                            f"{'non-negative' if zero else 'positive'} {'integer' if kind is int else 'number'}",
                            Location(display_path(path), line),
                            hint="write a number, e.g. flops = 5e10 (FLOP/s), memory = 8e9 (bytes)")
        return kind(value)

    device, cluster = data["device"], data["cluster"]
    matmul = device.get("matmul", {})
    if not isinstance(matmul, dict):
        raise UserError("`matmul` in [device] must be a table of FLOP/s per compute dtype",
                        Location(display_path(path), line_of("matmul")), hint="[device.matmul] fp32 = 5e13, bf16 = 6.8e14")
    for dtype in matmul:
        if dtype not in PRECISIONS:
            raise UserError(f"[device.matmul] has `{dtype}`: not a compute dtype", Location(display_path(path),
                            line_of(dtype, "device.matmul")), hint=f"compute dtypes: {', '.join(PRECISIONS)}")
    rates = tuple((dtype, number(matmul, "device.matmul", dtype)) for dtype in PRECISIONS if dtype in matmul)
    return ClusterSpec(name, number(device, "device", "flops"), number(device, "device", "memory"),
                       number(cluster, "cluster", "devices_per_node", int),
                       number(cluster, "cluster", "intra_bandwidth"), number(cluster, "cluster", "inter_bandwidth"),
                       number(cluster, "cluster", "latency"), number(cluster, "cluster", "devices", int, required=False),
                       rates, number(device, "device", "matmul_overhead", required=False, zero=True) or 0.0,
                       number(device, "device", "memory_bandwidth", required=False),
                       number(device, "device", "optimizer_seconds_per_param", required=False, zero=True),
                       op_overhead=number(device, "device", "op_overhead", required=False, zero=True) or 0.0,
                       matmul_half_rows=number(device, "device", "matmul_half_rows", required=False, zero=True) or 0.0,
                       overlap=_flag(cluster, "overlap", path, line_of("overlap", "cluster")))


def _flag(table: dict, key: str, path, line: int) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        from ..errors import Location, UserError, display_path
        raise UserError(f"`{key} = {value!r}` in [cluster]: expected true or false", Location(display_path(path), line),
                        hint="overlap = true where communication runs beside compute (GPUs), false where not")
    return value


def _short(func: str) -> str:
    return func.rsplit(".", 1)[-1]


@lru_cache(maxsize=None)
def _returns_alias(func: str) -> bool:
    """Whether torch's schema for the aten op behind `func` returns a view of its input
    (`Tensor(a) self -> Tensor(a)`): such ops move no bytes."""
    import torch
    packet = getattr(torch.ops.aten, _short(func).strip("_"), None)
    try:
        names = packet.overloads() if packet is not None else []
        schema = getattr(packet, "default" if "default" in names else names[0])._schema if names else None
    except (AttributeError, RuntimeError):
        return False
    return schema is not None and bool(schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def moves_no_bytes(node: Node, trace: Trace) -> bool:
    """A view (per torch's schemas) or an op that hands back its input unmodified (dropout with p=0)."""
    return bool(node.ops) and all(trace.ops[o].returns_input or _returns_alias(trace.ops[o].func)
                                  for o in node.ops)


def is_contraction(node: Node, dims: OpDims | None, trace: Trace) -> bool:
    """A label summed over that two floating operands both carry: FLOP-bound (an embedding's
    vocab is summed over in its dims, but only the table carries it: a gather, memory-bound)."""
    if dims is not None and _rule_flops(dims) is not None:
        return True
    if dims is None or not dims.reduced:
        return False
    for label in dims.reduced:
        carriers = [name for name, t in dims.inputs.items() if label in t.labels()
                    and trace.tensors[t.tid].dtype in _ELEMENT_BYTES]
        if len(carriers) >= 2:
            return True
    return False


def node_flops(node: Node, dims: OpDims | None, trace: Trace) -> float:
    """Forward FLOPs of a contraction: 2 · output elements · the products each one sums, which is
    the fewest elements an operand carries beyond the output's dims (a matmul's k; a conv's
    c·kh·kw, from its weight, not the c·h·w of its input); else elements touched. A lookup (an
    integer operand picks the rows of a table only it carries: an embedding) is no contraction, as
    is_contraction says: its output elements, not 2 · output · the table's rows."""
    ruled = _rule_flops(dims) if dims is not None else None
    if ruled is not None:
        return ruled
    if dims is not None and dims.reduced and not _looks_up(dims, trace):
        sizes = dims.sizes()
        kept = set().union(*(t.labels() for t in dims.outputs)) if dims.outputs else set()
        output = 1.0
        for label in kept:
            output *= sizes[label]
        window = min((_product(sizes[l] for l in t.labels() - kept) for t in dims.inputs.values()
                      if t.labels() - kept), default=1.0)
        return 2.0 * output * window
    sizes = [trace.tensors[t].nbytes / 4 for t in node.outputs] or [0.0]
    return max(sizes)


def _looks_up(dims: OpDims, trace: Trace) -> bool:
    """An integer operand beside a summed label no two floating operands share: a gather of rows."""
    return any(trace.tensors[t.tid].dtype not in _ELEMENT_BYTES for t in dims.inputs.values()) and \
        not is_contraction(None, dims, trace)


def _rule_flops(dims: OpDims) -> float | None:
    """2 · the multiply-adds its op rule counts (a fused op: attention), None without such a
    count or when a label it names is not among the op's (a factor split by refine)."""
    if not dims.flops:
        return None
    sizes = dims.sizes()
    total = 0.0
    for term in dims.flops:
        product = 1.0
        for label in term:
            if label.startswith("*"):
                bound = [s for name, s in sizes.items() if re.fullmatch(rf"{re.escape(label[1:])}\d+", name)]
                product *= _product(bound)
            elif label in sizes:
                product *= sizes[label]
            elif label.isdigit():           # a count a kind works out (a recurrent layer's steps x batch)
                product *= int(label)
            else:
                return None
        total += product
    return 2.0 * total


def contraction_rows(dims: OpDims, trace: Trace) -> float:
    """The fewer of a contraction's result rows and columns: the elements of its result only
    its first floating operand carries, or only its second (a linear's tokens and features).
    A fused op (its rule counts its FLOPs) is priced at the rate."""
    if dims.flops:
        return math.inf
    floating = [t for t in dims.inputs.values() if trace.tensors[t.tid].dtype in _ELEMENT_BYTES]
    if len(floating) < 2 or not dims.outputs:
        return math.inf
    sizes = dims.sizes()
    kept = set().union(*(t.labels() for t in dims.outputs))
    a, b = floating[0].labels(), floating[1].labels()
    return min(_product(sizes[l] for l in (a & kept) - b), _product(sizes[l] for l in (b & kept) - a))


def contraction_dtype(node: Node, trace: Trace, precision: str | None) -> str:
    """The dtype a contraction computes in: the plan's precision, else its operands' dtype."""
    if precision is not None:
        return precision
    dtype = next((trace.tensors[t].dtype for t in node.inputs if trace.tensors[t].dtype in _ELEMENT_BYTES),
                 "torch.float32")
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(dtype, "fp32")


_element_cache: dict[tuple[int, str | None], tuple[Trace, dict[int, int]]] = {}


def element_bytes(trace: Trace, dims_of, precision: str | None) -> dict[int, int]:
    """Bytes per element of each traced tensor as the step runs it: the traced dtype, or under
    autocast (bf16/fp16) contractions' outputs in half, AUTOCAST_FP32 ops' in float32, other
    ops' in the widest floating type they read. Parameters stay in their own dtype."""
    key = (id(trace), precision)
    cached = _element_cache.get(key)
    if cached is not None and cached[0] is trace:
        return cached[1]
    sizes = {tid: _ELEMENT_BYTES.get(t.dtype, t.nbytes // max(1, _numel(t.shape))) for tid, t in trace.tensors.items()}
    half = _HALF.get(precision or "")
    if half:
        for node in trace.nodes:
            floats = [sizes[t] for t in node.inputs if trace.tensors[t].dtype in _ELEMENT_BYTES]
            if is_contraction(node, dims_of(node.index), trace):
                size = half
            elif any(_short(trace.ops[o].func) in AUTOCAST_FP32 for o in node.ops):
                size = 4
            elif floats:
                size = max(floats)
            else:
                continue
            for tid in node.outputs:
                if trace.tensors[tid].dtype in _ELEMENT_BYTES and tid not in node.inputs:
                    sizes[tid] = size
    if len(_element_cache) > 8:         # traces of earlier analyses in this process
        _element_cache.clear()
    _element_cache[key] = (trace, sizes)
    return sizes


def _product(values) -> float:
    total = 1.0
    for value in values:
        total *= value
    return total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def node_time(node: Node, dims: OpDims | None, trace: Trace, device: DeviceSpec, ways: int = 1, *,
              dims_of=None, forward_only: bool = False, label: str | None = None) -> float:
    """Seconds of one device's forward and backward of `node` split `ways` ways (forward only
    when asked: what recompute or co-shard repeats, and for an op none of whose outputs needs a
    gradient: masks, indices, a recycling pass under no_grad have no backward). `dims_of(index)`
    gives any node's dims, for the autocast dtypes; without it, the traced dtypes. `label`: the
    split's label, whose split implementation's own collectives are added."""
    if moves_no_bytes(node, trace):
        return 0.0
    if node.outputs and not any(trace.tensors[t].requires_grad for t in node.outputs):
        forward_only = True
    if ways > 1 and dims is not None and dims.collectives and label in dims.impl:
        inside = _collectives_time(node, dims, trace, device, ways, forward_only)
        return inside + node_time(node, dims, trace, device, ways, dims_of=dims_of, forward_only=forward_only)
    if is_contraction(node, dims, trace):
        dtype = contraction_dtype(node, trace, device.precision)
        rate = device.matmul_rate(dtype)
        rows = contraction_rows(dims, trace) if device.matmul_half_rows else math.inf
        forward = device.matmul_overhead + node_flops(node, dims, trace) / ways / rate * \
            (1.0 + device.matmul_half_rows / rows)
        cast = 0.0
        if dtype in _HALF:      # autocast casts float32 operands (weights too) to half, read 4 and write 2 bytes,
            cast = sum(_numel(trace.tensors[t].shape) * 6 for t in node.inputs    # and their gradients back
                       if trace.tensors[t].dtype == "torch.float32") / ways / device.bytes_per_second
        if forward_only:
            return forward + cast
        return forward * (1.0 + CONTRACTION_BACKWARD) + 2.0 * cast
    sizes = element_bytes(trace, dims_of or (lambda _: None), device.precision if dims_of else None)
    moved = sum(_numel(trace.tensors[t].shape) * sizes[t] for t in {*node.inputs, *node.outputs})
    forward = device.op_overhead + moved / ways / device.bytes_per_second
    return forward * (1.0 if forward_only else 1.0 + MEMORY_BOUND_BACKWARD)


def _collectives_time(node: Node, dims: OpDims, trace: Trace, device: DeviceSpec, ways: int,
                      forward_only: bool) -> float:
    """What a split implementation communicates inside itself (OpDims.collectives), in the
    element size of its first result."""
    size = _ELEMENT_BYTES.get(trace.tensors[node.outputs[0]].dtype, 4) if node.outputs else 4
    total = 0.0
    for op, elements, calls, backward in dims.collectives:
        if backward and forward_only:
            continue
        price = all_reduce_time if op == "all_reduce" else all_gather_time
        total += calls * price(elements * size, ways, device)
    return total


def optimizer_time(params: float, device: DeviceSpec) -> float:
    """One optimizer step over `params` parameters held by this device."""
    return params * device.seconds_per_param


def compute_time(flops: float, split_ways: int, device: DeviceSpec) -> float:
    """FLOPs at the device's `flops` figure, forward + backward: for callers that price a FLOP
    count rather than an op (pipeline balancing)."""
    return 3.0 * flops / split_ways / device.flops


def all_reduce_time(nbytes: float, n: int, device: DeviceSpec) -> float:
    return device.latency + 2.0 * (n - 1) / n * nbytes / device.bandwidth


def all_gather_time(full_nbytes: float, n: int, device: DeviceSpec) -> float:
    return device.latency + (n - 1) / n * full_nbytes / device.bandwidth
