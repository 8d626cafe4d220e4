"""What a trace records: tensors, torch calls, and site invocations.

Plain data; no torch objects are kept here beyond what the tracer needs for identity.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..source.files import Span

class TensorList(tuple):
    """An operand value that is a list of tensors, by tensor id."""


class _Unknown:
    def __repr__(self) -> str:
        return "<value>"


UNKNOWN = _Unknown()   # an argument value the trace did not keep (objects, large lists)

# Where a tensor operand sits in the source call: ("self",), ("pos", i) or ("kw", name).
ArgPath = tuple


_ITEM_BYTES = {"torch.float64": 8, "torch.int64": 8, "torch.float16": 2, "torch.bfloat16": 2, "torch.bool": 1,
               "torch.int32": 4}


@dataclass
class TensorInfo:
    tid: int
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    producer: int | None = None        # node index; None for inputs, parameters, buffers
    param: str | None = None           # canonical parameter name
    buffer: str | None = None
    input_name: str | None = None      # name of the model input it is
    # its strides in the trace, when they are not the contiguous ones of its shape (a transposed
    # view reshaped: `x.as_strided(x.size(), x.stride())` reads memory in that order)
    stride: tuple[int, ...] | None = None
    # (address, bytes) of its storage in the trace, the same for every view of it
    storage: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        # kept with the shape and dtype it was computed from: the planner asks millions of times
        known = self.__dict__.get("_nbytes")
        if known is not None and known[0] is self.shape and known[1] is self.dtype:
            return known[2]
        n = 1
        for s in self.shape:
            n *= s
        n *= _ITEM_BYTES.get(self.dtype, 4)
        self.__dict__["_nbytes"] = (self.shape, self.dtype, n)
        return n


@dataclass
class Operand:
    """A named input of a site invocation: a tensor, or a plain value (ints, None, ...)."""

    name: str
    path: ArgPath | None      # where it sits in the user's call; None for module parameters
    tid: int | None = None    # set for tensors
    value: Any = None         # set for non-tensors (kept only when small and printable)


@dataclass
class OpCall:
    """One torch call, as TorchFunctionMode saw it."""

    func: str                       # canonical name: torch.matmul, Tensor.view, torch.nn.functional.gelu
    node: int                       # the invocation it belongs to
    inputs: list[int]
    outputs: list[int]
    mapped: bool
    returns_input: bool = False     # every output is an input object the call left unmodified
    reduction: str | None = None    # a loss function's reduction= ("mean", "sum", ...), when given
    # operands the call wrote in place (out=, Tensor.add_, setitem, BatchNorm's running statistics):
    # (tid before the write, tid of the result that hands it back or None), to find the buffers a
    # forward changes (plan/batch.py buffers_written)
    writes: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class Node:
    """One invocation of a source site: the model file called `callee` at `span`."""

    index: int
    span: Span | None               # None when no frame of the model's own files was on the stack
    callee: str                     # what the model file called: a torch function or method, a module type, a helper
    callee_kind: str                # "torch", "module" or "function"
    module_path: str                # e.g. transformer.h.0.attn
    callee_path: str | None = None  # the module called, when the callee is a module (transformer.h.0.attn.c_attn)
    operands: list[Operand] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)      # OpCall indices
    outputs: list[int] = field(default_factory=list)  # tensors produced here and used elsewhere, in order
    produced: list[int] = field(default_factory=list)  # every tensor produced inside, in order
    mapped: bool = False

    @property
    def inputs(self) -> list[int]:
        return [op.tid for op in self.operands if op.tid is not None]

    def operand(self, name: str) -> Operand | None:
        return next((op for op in self.operands if op.name == name), None)


@dataclass
class ParamInfo:
    name: str                        # canonical (first) name
    aliases: list[str]               # every name it is reachable by (tied weights)
    shape: tuple[int, ...]
    module_type: str                 # owner module's class, fully qualified
    attr: str                        # attribute name on the owner (weight, bias)
    ctor_span: Span | None           # constructor call that created it, in the model's files
    tid: int | None = None
    ctor_caller: Span | None = None  # the own-file call one frame above ctor_span (a layer-building helper's call)


@dataclass
class StateWrite:
    """The forward set a plain attribute of a module to a new value (`self.attention_type = v`):
    state a pipeline stage that does not run this code would not see."""

    module: str                      # module path of the object written ("" for the root)
    attr: str
    node: int                        # index of the last node recorded before the write (-1: none)
    stack: list[Span]                # the model's own frames at the write, innermost first


@dataclass
class Trace:
    mode: str                        # "fake" or "real"
    own_files: list[str]
    nodes: list[Node]
    ops: list[OpCall]
    tensors: dict[int, TensorInfo]
    params: dict[str, ParamInfo]     # canonical name -> info
    inputs: dict[str, int]           # model input name -> tensor id
    loss: int | None                 # tensor id of the training loss
    module_types: dict[str, str]     # module path -> fully qualified class
    batch_size: int | None = None
    size_queries: list[tuple[Span, int, int | None]] = field(default_factory=list)  # (site, tensor, dim)
    module_calls: dict[str, tuple[Span, int]] = field(default_factory=dict)  # path -> (call site, first node)
    containers: dict[Span, list[tuple[str, ...]]] = field(default_factory=dict)  # nn.Sequential call -> leaves
    replays: dict[int, Any] = field(default_factory=dict)   # node index -> trace.replay.Replay
    state_writes: list[StateWrite] = field(default_factory=list)   # module attributes the forward changed
    module_runs: dict[str, int] = field(default_factory=dict)      # module path -> forward calls in one step
    module_replays: dict[str, Any] = field(default_factory=dict)   # module path -> its first call, as a Replay
    # a module object registered under several names (one embedding as `shared` and `encoder.embed`):
    # the name the trace calls it by -> its other names
    module_aliases: dict[str, list[str]] = field(default_factory=dict)
    # nn.Sequential calls whose calls run different lists of layers: their layers cannot be cut
    # apart in the one source line (containers holds the first call's leaves)
    mixed_containers: set[Span] = field(default_factory=set)
    # bytes autograd keeps for backward, by the node whose op made each storage (each counted once)
    saved: dict[int, int] = field(default_factory=dict)
    # the storages alive from forward to backward anyway: those autograd saved, parameters,
    # buffers and the inputs (a checkpoint keeping one of them adds nothing)
    kept_storages: set[int] = field(default_factory=set)
    # modules whose state_dict() hooks write other keys than their parameters' names (torchtitan's
    # fused wqkv saved as wq, wk, wv): their keys' splits are probed (materialize/state_keys.py)
    state_dict_hooked: list[str] = field(default_factory=list)
    # nn.Sequential calls on a subclass with its own constructor (torchvision's FCNHead): a slice
    # `head[2:]` rebuilds the class from a dict of layers, which its constructor does not take
    unsliceable_containers: set[Span] = field(default_factory=set)
    # each module a line of the model's code calls (module_calls, not the layers it runs): the
    # layers that call runs, in order, with their classes (an nn.Sequential's leaves; the module
    # itself, `()`): a line whose calls run unlike lists has instances that run it unalike
    line_layers: dict[str, list[tuple[tuple[str, ...], str]]] = field(default_factory=dict)

    def module_type(self, path: str) -> str:
        """The class of the module at `path`, under any of its names ("" if none)."""
        if path in self.module_types:
            return self.module_types[path]
        return next((self.module_types.get(name, "") for name, others in self.module_aliases.items()
                     if path in others), "")
