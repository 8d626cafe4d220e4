"""Trace: build the model, run forward + loss (+ backward) once, record every torch call.

Each torch call is attributed to the innermost frame in the model's own files (its exact
code position via co_positions), and grouped with the other calls made from that same
frame position into one Node: "the model file called `callee` here". Parameters are tied
to the constructor call that created them.

The trace runs under FakeTensorMode when it can (no real memory or compute), else on real
CPU tensors. Backward records nothing; on real tensors it runs (a model that cannot train is
refused here), on fake ones it is skipped: at a production shape it is a third of the trace,
and `verify` runs it on real tensors. A saved_tensors_hooks pair around the forward records
what autograd keeps for backward (the memory model's activations). It must not rewrite anything.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

import libcst as cst
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..errors import Location, UserError, display_path
from ..lifetimes import objects_so_far_kept
from ..runtime._comm import map_tensors
from ..source.entry import Entry, user_frame_location, instruction_position as _position
from ..source.files import SourceSet, Span, resolved
from .naming import layer_type, qualified_type, short_type, torch_func_name, traced_split
from .records import UNKNOWN, Node, OpCall, Operand, ParamInfo, StateWrite, TensorInfo, TensorList, Trace
from .replay import Replay, arguments_at_entry, call_arguments, function_of, with_refs
from .replicate import Replicator

# Folders as prefixes of a code's file name, ending in the separator: without it, `.../torch`
# also begins `.../torchtitan/...` and `.../torch_einops_utils/...`, libraries whose helpers are
# not torch's own code.
_TORCH_DIR = os.path.join(str(Path(torch.__file__).parent), "")
_OUR_DIR = os.path.join(str(Path(__file__).resolve().parents[1]), "")
_MODULE_CALL = {"_wrapped_call_impl", "_call_impl"}
_SIZE_QUERIES = {"Tensor.size", "Tensor.shape"}
_SETITEM = torch._C.TensorBase.__setitem__   # returns None; its result is the new version of x
# Calls that read only the dtype and device of their other tensor (`mask.type_as(h)`): that
# tensor is no data input, so its layout and batch never constrain the call.
_READS_DTYPE_OF_OTHERS = {"Tensor.type_as", "Tensor.to"}
_WRAPPER_NAMES = {"wrapper", "inner", "wrapped", "decorate_context", "_fn", "new_fn"}
# Containers whose forward only calls their children in order: a call to one from the model's
# file is recorded as calls to each child, so a rewrite can unroll it and work between them.
_CONTAINERS = (torch.nn.Sequential,)
# `MyFunction.apply(a, b)`: a custom autograd Function is one op of the line that applies it.
# Its forward's torch calls are that op's parts (its backward may read any input, which no
# traced op does), so the node takes every tensor argument of the apply.
_APPLY = torch.autograd.Function.apply.__func__.__code__


class _CtorRecorder:
    """Records, while the model is built, the call stack that created each Parameter.

    The model's own files are known only after the build, so the stack is kept as
    (file, position, type being constructed) per frame and resolved afterwards.
    """

    def __init__(self):
        self.stacks: dict[int, list[tuple]] = {}
        self._original = None

    def __enter__(self):
        original = torch.nn.Parameter.__new__
        stacks = self.stacks
        outside = sys._getframe(1)      # the tool's frames from here out: no model file among them

        def recording_new(cls, data=None, requires_grad=True):
            param = original(cls, data, requires_grad)
            stack, frame = [], sys._getframe(1)
            while frame is not None and frame is not outside:
                owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
                constructing = type(owner) if isinstance(owner, torch.nn.Module) else None
                stack.append((frame.f_code.co_filename, _position(frame), constructing))
                frame = frame.f_back
            stacks[id(param)] = stack
            return param

        def recording_deepcopy(value, memo=None, _nil=[]):     # noqa: B006 - copy.deepcopy's own signature
            memo = {} if memo is None else memo
            copied = deepcopy(value, memo, _nil)
            for original_id, copy_ in list(memo.items()):
                # a copy of a recorded parameter (nn.TransformerEncoder clones its layer) was
                # created where the original was, and is built at its size (on real tensors the
                # copy's own Parameter() inside deepcopy was recorded first: the original's wins)
                if isinstance(copy_, torch.nn.Parameter) and original_id in stacks:
                    stacks[id(copy_)] = stacks[original_id]
            return copied

        self._original, deepcopy = original, copy.deepcopy
        self._deepcopy = deepcopy
        torch.nn.Parameter.__new__ = staticmethod(recording_new)
        copy.deepcopy = recording_deepcopy
        return self

    def __exit__(self, *exc):
        torch.nn.Parameter.__new__ = self._original
        copy.deepcopy = self._deepcopy
        return False


class _CopiedBlocks:
    """While the forward runs: nn.Module's call of a repeated block goes through the Replicator."""

    def __init__(self, replicator):
        self.replicator = replicator
        self._original = None

    def __enter__(self):
        replicator = self.replicator
        if replicator is None or not replicator.candidates:
            return self
        original = self._original = torch.nn.Module._call_impl
        candidates = replicator.candidates

        def calling(module, *args, **kwargs):
            if id(module) in candidates and not replicator.busy:
                return replicator.call(original, module, args, kwargs)
            return original(module, *args, **kwargs)
        torch.nn.Module._call_impl = calling
        return self

    def __exit__(self, *exc):
        if self._original is not None:
            torch.nn.Module._call_impl = self._original
        return False


class _StateWriteRecorder:
    """Records, during the forward, each plain module attribute the model's code changes
    (`self.attention_type = "original_full"`): module path, name, and the model's own frames.
    A write of the value already there is no change and is not recorded."""

    _MISSING = object()

    def __init__(self, tracer: "Tracer"):
        self.tracer = tracer
        self._original = None

    def __enter__(self):
        original = torch.nn.Module.__setattr__
        tracer, missing = self.tracer, self._MISSING

        def recording_setattr(module, name, value):
            if tracer._recording and not name.startswith("__"):
                state = module.__dict__
                old = state.get(name, missing)
                if old is missing:
                    for store in ("_parameters", "_buffers", "_modules"):
                        if name in state.get(store, {}):
                            old = state[store][name]
                            break
                if _changed(old, value):
                    tracer._state_written(module, name, sys._getframe(1))
            original(module, name, value)

        self._original = original
        torch.nn.Module.__setattr__ = recording_setattr
        return self

    def __exit__(self, *exc):
        torch.nn.Module.__setattr__ = self._original
        return False


def _changed(old, new) -> bool:
    if old is new:
        return False
    # tensors, also inside a list or dict (RAFT's `self.corr_pyramid = [corr_volume]`): compared
    # with ==, they would run a Tensor.__eq__ the trace records as the model's op at that line
    if any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten((old, new))[0]):
        return True
    try:
        return not bool(old == new)
    except Exception:  # noqa: BLE001 - an object without a plain equality: count it as changed
        return True


def _inode(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file a path names, symlinks followed; None when it cannot be read."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):
        return None
    return found.st_dev, found.st_ino


class Tracer(TorchFunctionMode):
    def __init__(self, sources: SourceSet, entry: Entry, library_modules: tuple[str, ...] = (),
                 leaf_types: frozenset = frozenset(), traced_modules: tuple[str, ...] = (), replicate: bool = False):
        super().__init__()
        self.replicate = replicate      # copy the records of repeated blocks (trace/replicate.py)
        self.replicator: Replicator | None = None
        self.sources = sources
        self.entry = entry
        self.library_modules = tuple(library_modules)
        # torch's or a library's modules traced as the model's own; of some, only the classes named
        # (their other classes, nn.ReLU beside nn.MultiheadAttention, stay one op each: leaf layers)
        self.traced_modules, self._traced_classes = traced_split(traced_modules)
        # Layer classes of the model's files called as one op at each call site (see role_layers)
        self.leaf_types = frozenset(leaf_types)
        self._leaf_ids: set[int] = set()      # id() of their instances in the model being traced
        self.role_layers: frozenset = frozenset()   # found by this trace: see _role_layers
        self.own_files: set[str] = {str(entry.path)}
        self.nodes: list[Node] = []
        self.ops: list[OpCall] = []
        self.tensors: dict[int, TensorInfo] = {}
        self._tid_of: dict[int, int] = {}     # id(tensor) -> tid
        self._keep: list[Any] = []             # keeps traced tensors alive so ids stay unique
        self._module_names: dict[int, str] = {}
        self._current: tuple | None = None     # (frame, lasti, ...) of the open invocation
        self._recording = False
        self.size_queries: list[tuple[Span, int, int | None]] = []
        self.module_calls: dict[str, tuple[Span, int]] = {}   # module path -> (call site, first node index)
        self.module_runs: dict[str, int] = {}
        self.containers: dict[Span, list[tuple[str, ...]]] = {}   # container call -> its leaves, in order
        self._container_kinds: dict[Span, list[tuple[tuple[str, ...], type]]] = {}   # ... and their classes
        self.mixed_containers: set[Span] = set()    # container calls whose calls run different layers
        self.unsliceable_containers: set[Span] = set()  # container calls whose class cannot be sliced
        self._called_paths: dict[Span, list[str]] = {}   # module call line -> the modules it called
        self.line_layers: dict[str, list[tuple[tuple[str, ...], str]]] = {}   # module called from a line -> what it runs
        self.replays: dict[int, Replay] = {}   # node index -> how to call it again
        self._entry_args: dict[int, tuple] = {}    # id(frame) -> (code, parameter values) as the call began
        self._awaiting: dict[int, Replay] = {}     # id(frame or module) -> replay whose results are not yet seen
        self.module_replays: dict[str, Replay] = {}    # module path -> its first call as a whole
        self._awaiting_modules: dict[int, Replay] = {}
        self.state_writes: list[StateWrite] = []
        self._callbacks: dict[int, tuple] = {}     # id(frame) -> (frame, whether library code called it back)
        # what autograd keeps for backward (see _saved_by_node): storage -> the node whose op made
        # it (None: parameters, buffers, inputs), and each storage saved -> (bytes, ops recorded before)
        self._storage_maker: dict[int, int | None] = {}
        self._saved_storages: dict[int, tuple[int, int]] = {}
        self._sites: dict[tuple, tuple] = {}    # (code, instruction) -> (span, source node): see _site
        # while a repeated block's first call runs: what the records above were given in order
        # (trace/replicate.py plays it again for the block's copies); None otherwise
        self._log: list | None = None

    # ---- frames -------------------------------------------------------------------------
    def own_frame(self, frame):
        if self._leaf_ids:
            return self._own_and_leaf(frame)[0]
        found = None
        while frame is not None:
            if frame.f_code.co_filename in self.own_files:
                if not self._called_back(frame):
                    return frame
                found = found or frame      # kept in case no own frame made the library call
            frame = frame.f_back
        return found

    def _own_and_leaf(self, frame) -> tuple[Any, bool]:
        """(the innermost own frame outside every call of a leaf layer, whether `frame` runs
        inside such a call): a leaf layer's forward is one op of its caller, not model lines."""
        found, callback, inside = None, None, False
        while frame is not None:
            if frame.f_code.co_name in _MODULE_CALL and id(frame.f_locals.get("self")) in self._leaf_ids:
                found, callback, inside = None, None, True
            elif found is None and frame.f_code.co_filename in self.own_files:
                if self._called_back(frame):
                    callback = callback or frame
                else:
                    found = frame
            frame = frame.f_back
        return found or callback, inside

    def _called_back(self, frame) -> bool:
        """A helper of the model's files that library code calls back (transformers' grouped_mm
        experts call the model's `Experts._apply_gate`) runs inside that library call, which is
        one op of the model line that made it: its lines are not sites of their own (their
        results go back to code the rewrite does not touch). Not a call back: a module's forward
        (model code whatever calls it), and a function called by a decorator's wrapper (which
        holds the function it wraps)."""
        known = self._callbacks.get(id(frame))
        if known is not None and known[0] is frame:
            return known[1]
        caller = frame.f_back
        answer = caller is not None and (caller.f_code is _APPLY or frame.f_code.co_name != "forward"
                                         and not _model_or_torch_frame(caller, self.own_files)
                                         and not _holds_function(caller, frame.f_code))
        self._callbacks[id(frame)] = (frame, answer)     # the frame is kept, so its id is not reused
        return answer

    @staticmethod
    def _chain(frame, own) -> list:
        """The frames between the own frame and the torch call, innermost first."""
        chain = []
        while frame is not None and frame is not own:
            chain.append(frame)
            frame = frame.f_back
        return [f for f in chain if not f.f_code.co_filename.startswith(_OUR_DIR)]

    def _container_child(self, chain) -> tuple[Any, Any] | None:
        """When the own frame called a container: (the container, the child module call frame running)."""
        container = None
        for f in reversed(chain):
            module = f.f_locals.get("self") if f.f_code.co_name in _MODULE_CALL else None
            if module is None:
                continue
            if container is None and not isinstance(module, _CONTAINERS):
                return None
            if isinstance(module, _CONTAINERS):
                container = container or module
            else:
                return container, f
        return None

    def _via(self, container, child) -> tuple[str, ...]:
        """How the child is reached from the container: ("1",) for `head[1]`, ("0", "2") nested."""
        outer = self._module_names.get(id(container), "")
        inner = self._module_names.get(id(child), "")
        return tuple(inner[len(outer) + 1:].split(".")) if outer else tuple(inner.split("."))

    def _callee(self, func, frame, own, contained) -> tuple[str, str, Any]:
        """What the own frame called: (name, kind, callee frame or None); `contained`: the
        container call and child frame when it called an nn.Sequential."""
        chain = self._chain(frame, own)
        if not chain:
            return torch_func_name(func), "torch", None
        if contained is not None:
            child_frame = contained[1]
            return short_type(qualified_type(layer_type(type(child_frame.f_locals["self"])))), "module", child_frame
        outer = chain[-1]
        if outer.f_code is _APPLY:
            function = outer.f_locals["cls"]
            return f"{function.__module__}.{function.__qualname__}.apply", "function", outer
        if outer.f_code.co_name in _MODULE_CALL and isinstance(outer.f_locals.get("self"), torch.nn.Module):
            return short_type(qualified_type(layer_type(type(outer.f_locals["self"])))), "module", outer
        if outer.f_code.co_filename.startswith(_TORCH_DIR):
            return torch_func_name(func), "torch", None
        i = len(chain) - 1
        while i > 0 and _wraps(chain[i], chain[i - 1].f_code):
            i -= 1
        inner = chain[i]
        return f"{inner.f_globals.get('__name__', '?')}.{inner.f_code.co_qualname}", "function", inner

    def _module_path(self, own) -> str:
        frame = own
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and id(owner) in self._module_names:
                return self._module_names[id(owner)]
            frame = frame.f_back
        return ""

    # ---- tensors ------------------------------------------------------------------------
    def _tid(self, tensor: torch.Tensor, **info) -> int:
        key = id(tensor)
        if key in self._tid_of:
            return self._tid_of[key]
        tid = len(self.tensors)
        self._tid_of[key] = tid
        self._keep.append(tensor)
        storage = _storage(tensor)
        self.tensors[tid] = TensorInfo(tid, tuple(tensor.shape), str(tensor.dtype),
                                       bool(tensor.requires_grad), stride=_strides(tensor),
                                       storage=None if storage is None else (storage, tensor.untyped_storage().nbytes()),
                                       **info)
        return tid

    # ---- the mode -----------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The profile hook looks only at library calls made from the model's files; inside a torch
        # op (fake-tensor dispatch is Python) and in the recording below it would see millions of
        # events for nothing.
        profiler = sys.getprofile()
        sys.setprofile(None)
        try:
            return self._run_and_record(func, args, kwargs or {})
        finally:
            sys.setprofile(profiler)

    def _run_and_record(self, func, args, kwargs):
        if not self._recording:
            return func(*args, **kwargs)
        # Recording reads tensors' shapes, strides and storages: with torch functions off, those
        # reads skip the modes below this one (SmallConstants), a Python call each per tensor read.
        with torch._C.DisableTorchFunction():
            flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            versions = {id(t): t._version for t in flat_in}
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            result = args[0] if func is _SETITEM else out
            flat_out = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            if flat_out:
                # an input handed back unmodified (dropout with p=0): the cost model prices it at nothing
                unmodified = all(versions.get(id(t)) == t._version for t in flat_out)
                # operands written in place (out=, add_, BatchNorm's running statistics)
                written = [t for t in flat_in if versions[id(t)] != t._version]
                self._record(func, args, kwargs, flat_out, unmodified, written)
            elif args and isinstance(args[0], torch.Tensor) and torch_func_name(func) in _SIZE_QUERIES:
                self._record_size_query(args, kwargs)
        return out

    def _module_called(self, module, args, caller=None):
        """Where the model's own code calls each module (the loop over blocks, for pipelining).
        `caller`: the frame of a direct `module.forward(x)` call (else the hook's caller's)."""
        caller = caller if caller is not None else sys._getframe(1)
        path = self._module_names.get(id(module))
        log = self._log
        if path is not None:
            self.module_runs[path] = self.module_runs.get(path, 0) + 1
            if log is not None:
                log.append(("run", module))
        if id(module) in self._leaf_ids:
            self._current = None    # each call of a leaf layer is a node, in a loop too
        if path is None:
            return
        if self._leaf_ids and self._own_and_leaf(caller)[1] and id(module) not in self._leaf_ids:
            return                  # a module a leaf layer calls: part of that op
        if id(module) not in self._leaf_ids:
            present = path in self.module_replays
            if not present:
                self._record_module_call(module, path)
            if log is not None:
                log.append(("replay", module, "present" if present else self.module_replays.get(path, "unset")))
        if path in self.module_calls:
            if log is not None:
                log.append(("call", module, "present"))
            return
        own = self.own_frame(caller)
        span = self._span(own) if own is not None and own.f_locals.get("self") is not module else None
        if log is not None:
            log.append(("call", module, span, len(self.nodes)))
        if span is not None:
            self._first_call(module, path, span, len(self.nodes))

    def _first_call(self, module, path: str, span: Span, node: int) -> None:
        """The first call of the module at `path`, from the own line at `span`, before node `node`."""
        self.module_calls[path] = (span, node)
        if any(path.startswith(c + ".") for c in self._called_paths.get(span, ())):
            return      # a layer (or nested container) that a module called from this line runs
        self._called_paths.setdefault(span, []).append(path)
        # one line may call containers of different layers, or a container and another
        # module (a loop over a model's children: IntermediateLayerGetter)
        kinds = self._leaf_kinds(module) if isinstance(module, _CONTAINERS) else [((), layer_type(type(module)))]
        self.line_layers[path] = [(via, qualified_type(kind)) for via, kind in kinds]
        if self._container_kinds.setdefault(span, kinds) != kinds:
            self.mixed_containers.add(span)
        if isinstance(module, _CONTAINERS):
            self.containers.setdefault(span, [via for via, _ in kinds])
            if type(module).__init__ is not torch.nn.Sequential.__init__:
                self.unsliceable_containers.add(span)

    def _record_module_call(self, module, path: str) -> None:
        """The module's first call as a whole, from the frame of nn.Module's call that holds its
        arguments: graph/batch_probe.py calls it again to see whether the module keeps the
        samples of a batch apart when ops inside it (a MoE router's sort) do not."""
        frame = sys._getframe(2)
        for _ in range(3):
            if frame is None or frame.f_code.co_name == "_call_impl":
                break
            frame = frame.f_back
        if frame is None or frame.f_code.co_name != "_call_impl" or frame.f_locals.get("self") is not module:
            return
        state = {name: self._tid(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        replay = Replay(module, with_refs(frame.f_locals.get("args", ()), self._tid),
                        with_refs(frame.f_locals.get("kwargs", {}), self._tid), state)
        self.module_replays[path] = replay
        self._awaiting_modules[id(module)] = replay

    def _leaf_kinds(self, container) -> list[tuple[tuple[str, ...], type]]:
        """The modules a container call runs, in order, nested containers flattened, with their
        classes: one line calling blocks built differently (MobileNet's inverted residuals, with
        and without an expansion layer) runs different lists."""
        def leaves(module):
            return [m for child in module.children()
                    for m in (leaves(child) if isinstance(child, _CONTAINERS) else [child])]
        return [(self._via(container, m), layer_type(type(m))) for m in leaves(container)]

    def _record_size_query(self, args, kwargs):
        """`x.size(-1)` / `x.shape`: where a size came from, so a rewrite never divides it twice."""
        reader = sys._getframe(3)
        own, inside = self._own_and_leaf(reader) if self._leaf_ids else (self.own_frame(reader), False)
        if own is None or inside or self._in_library_layer(reader, own):
            return
        span = self._span(own)
        if span is not None:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            self.size_queries.append((span, self._tid(args[0]), dim if isinstance(dim, int) else None))

    @staticmethod
    def _in_library_layer(frame, own) -> bool:
        """Whether a size read happens in the forward of a module the trace does not follow
        (torch's InstanceNorm2d compares its input's channels with its num_features): the layer
        is one op, its rule derived as a whole, and the model's line reads no size."""
        while frame is not None and frame is not own:
            if frame.f_code.co_name in _MODULE_CALL or frame.f_code is _APPLY:
                return True
            frame = frame.f_back
        return False

    def _record(self, func, args, kwargs, flat_out, returns_input: bool = False, written: list = ()):
        caller = sys._getframe(3)
        own = self.own_frame(caller)
        in_tids = [self._tid(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        chain = self._chain(caller, own) if own is not None else []
        contained = self._container_child(chain) if own is not None else None
        # The frame itself, not its id: two lambdas called one after the other (`lambda:
        # create_causal_mask(...)`, then `lambda: create_sliding_window_causal_mask(...)`) may run
        # in frames at the same address, at the same instruction; holding the open one keeps it apart.
        # The outermost frame below the own one is the call the own frame made: a loop calling a
        # module per iteration from one instruction (`x = layer(x)` over a ModuleList, or over a
        # model's children) makes a new one each time, so each call is a node of its own.
        key = (own, own.f_lasti, chain[-1] if chain else None,
               contained and id(contained[1].f_locals["self"])) if own is not None else None
        # A torch function the own frame calls itself is one invocation per call: a loop whose body
        # makes just that call (`parts.append(x[i])`) repeats the key and still gets a node per
        # iteration. Calls made below a helper or module share the key of the own frame's call.
        if key is None or key != self._current or not chain:
            self._open_node(func, args, kwargs, caller, own, contained)
            self._current = key
        node = self.nodes[-1]
        # an operand written and not handed back (BatchNorm's running mean) keeps its tid; most ops
        # write nothing, and pay nothing here
        written_ids = {id(t) for t in written}
        handed_back = {id(t) for t in flat_out} if written else set()
        writes = [(self._tid_of[id(t)], None) for t in written if id(t) not in handed_back and id(t) in self._tid_of]
        out_tids = []
        for tensor in flat_out:
            before = self._tid_of.pop(id(tensor), None)   # an in-place result is a new version
            tid = self._tid(tensor, producer=node.index)
            storage = _storage(tensor)
            if storage is not None:
                self._storage_maker.setdefault(storage, node.index)
                if self._log is not None:
                    self._log.append(("made", storage, node.index))
            out_tids.append(tid)
            node.produced.append(tid)
            if before is not None and id(tensor) in written_ids:
                writes.append((before, tid))
        replay = self.replays.get(node.index)
        if replay is not None and replay.outputs is None and replay.fn is func:
            replay.outputs = out_tids
        reduction = kwargs.get("reduction") if kwargs else None
        self.ops.append(OpCall(torch_func_name(func), node.index, in_tids, out_tids, node.mapped, returns_input,
                               reduction if isinstance(reduction, str) else None, writes))
        node.ops.append(len(self.ops) - 1)

    def _span(self, own) -> Span | None:
        pos = _position(own)
        if not pos or pos[0] is None:
            return None
        source = self.sources.get(own.f_code.co_filename)
        line, end_line, col, end_col = pos
        return Span(str(source.path), line, source.char_col(line, col), end_line, source.char_col(end_line, end_col))

    def _site(self, own) -> tuple[Span | None, Any]:
        """(the span of the own frame's current call, its source node or None), once per code
        position: a block's lines run once per layer."""
        key = (own.f_code, own.f_lasti)
        known = self._sites.get(key)
        if known is None:
            span, found = self._span(own), None
            if span is not None:
                source = self.sources.get(span.path)
                found = source.node_at(span.line, span.col, span.end_line, span.end_col)
                if found is not None:      # a method chain over lines starts its bytecode range at `.meth`
                    span = source.span_of(found)
            known = self._sites[key] = (span, found)
        return known

    def _open_node(self, func, args, kwargs, caller, own, contained=None):
        span, mapped, found = None, False, None
        if own is not None:
            span, found = self._site(own)
            if span is not None:
                mapped = found is not None
                if contained is not None:
                    container, child_frame = contained
                    span = dataclasses.replace(span, via=self._via(container, child_frame.f_locals["self"]))
        callee, kind, callee_frame = self._callee(func, caller, own, contained) if own is not None else (
            torch_func_name(func), "torch", None)
        node = Node(len(self.nodes), span, callee, kind, self._module_path(own) if own else "", mapped=mapped)
        if kind == "module":
            node.callee_path = self._module_names.get(id(callee_frame.f_locals["self"]))
        node.operands = self._operands(func, kind, callee_frame, args, kwargs, found)
        self.nodes.append(node)
        replay = self._replay(func, kind, callee_frame, args, kwargs)
        if replay is not None:
            self.replays[node.index] = replay

    def _replay(self, func, kind, callee_frame, args, kwargs) -> Replay | None:
        """How to call this invocation again; its results are filled in when it returns."""
        if kind == "torch":
            return None if func is _SETITEM else Replay(func, with_refs(args, self._tid), with_refs(kwargs, self._tid))
        if kind == "module":
            module = callee_frame.f_locals["self"]
            state = {name: self._tid(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
            replay = Replay(module, with_refs(callee_frame.f_locals.get("args", ()), self._tid),
                            with_refs(callee_frame.f_locals.get("kwargs", {}), self._tid), state)
            self._awaiting[id(module)] = replay
            return replay
        entry = self._entry_args.get(id(callee_frame))
        fn = function_of(callee_frame.f_code, callee_frame.f_globals)
        if entry is None or entry[0] is not callee_frame.f_code or fn is None:
            return None
        call_args, call_kwargs = call_arguments(callee_frame.f_code, entry[1])
        replay = Replay(fn, with_refs(call_args, self._tid), with_refs(call_kwargs, self._tid))
        self._awaiting[id(callee_frame)] = replay
        return replay

    def _arguments(self, frame) -> dict:
        """A called function's parameters as the call began, else as they are now."""
        entry = self._entry_args.get(id(frame))
        return entry[1] if entry is not None and entry[0] is frame.f_code else frame.f_locals

    def _returned(self, key: int, result, awaiting: dict | None = None) -> None:
        replay = (self._awaiting if awaiting is None else awaiting).pop(key, None)
        if replay is not None:
            flat = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            if all(id(t) in self._tid_of for t in flat):
                replay.outputs = [self._tid_of[id(t)] for t in flat]

    def _module_returned(self, module, args, result):
        self._returned(id(module), result)
        self._returned(id(module), result, self._awaiting_modules)

    def _profile(self, frame, event, arg):
        """sys.setprofile hook: the arguments of each library function the model's files call,
        as the call begins (the function may rebind them before its first torch call)."""
        if event == "call":
            back = frame.f_back
            code = frame.f_code
            if code.co_name == "forward" and back is not None and back.f_code.co_filename in self.own_files:
                self._forward_called(frame, back)
            if back is not None and (back.f_code.co_filename in self.own_files or _wraps(back, code)) \
                    and code.co_filename not in self.own_files and not code.co_filename.startswith(_TORCH_DIR):
                self._entry_args[id(frame)] = (code, arguments_at_entry(frame))
        elif event == "return":
            if self._entry_args.pop(id(frame), None) is not None:
                self._returned(id(frame), arg)
            if frame.f_code is _APPLY:
                self._applied(arg)

    def _applied(self, result) -> None:
        """A custom Function's forward runs with grad off: its results, recorded there as needing
        no gradient, need one once apply attaches its backward (a planner that believed them
        constant would split their consumers without reducing the gradient they send back)."""
        with torch._C.DisableTorchFunction():
            for t in tree_flatten(result)[0]:
                tid = self._tid_of.get(id(t)) if isinstance(t, torch.Tensor) else None
                if tid is not None:
                    self.tensors[tid].requires_grad = bool(t.requires_grad)

    def _forward_called(self, frame, caller) -> None:
        """`block.forward(x)` written in the model's own code (SqueezeBERT's loop over its layers)
        bypasses nn.Module's call and its hooks: it is a call of the block all the same, from that
        line. Not one: nn.Module's call running the forward, a forward calling its base class's
        (`super().forward(x)`, self the same module), a decorator's wrapper calling the forward."""
        module = frame.f_locals.get("self")
        if not isinstance(module, torch.nn.Module) or id(module) not in self._module_names \
                or caller.f_locals.get("self") is module or _wraps(caller, frame.f_code) \
                or frame.f_code.co_filename not in self.own_files:
            return
        self._module_called(module, (), caller)

    def _operands(self, func, kind, callee_frame, args, kwargs, call=None) -> list[Operand]:
        """Name every input of the invocation and where it sits in the user's call (`call`, its
        source node, when the trace found it)."""
        operands: list[Operand] = []
        if kind == "module":
            module = callee_frame.f_locals["self"]
            call_args, call_kwargs = callee_frame.f_locals.get("args", ()), callee_frame.f_locals.get("kwargs", {})
            for i, value in enumerate(call_args):
                operands.append(self._operand(f"arg{i}", ("pos", i), value))
            for name, value in call_kwargs.items():
                operands.append(self._operand(name, ("kw", name), value))
            for name, param in module.named_parameters(recurse=True):
                operands.append(Operand(f"self.{name}", None, tid=self._tid(param)))
            for name, buf in module.named_buffers(recurse=True):
                operands.append(Operand(f"self.{name}", None, tid=self._tid(buf)))
        elif kind == "function" and callee_frame.f_code is _APPLY:
            values = callee_frame.f_locals
            for i, value in enumerate(values.get("args", ())):
                operands.append(self._operand(f"arg{i}", ("pos", i), value))
            for name, value in (values.get("kwargs") or {}).items():
                operands.append(self._operand(name, ("kw", name), value))
        elif kind == "function":
            code = callee_frame.f_code
            values = self._arguments(callee_frame)
            n_pos = code.co_argcount + code.co_kwonlyargcount
            bound = int(_binds_first_parameter(code, values, call))
            written_positional = _positional_count(call)
            for i, name in enumerate(code.co_varnames[:n_pos]):
                if name in values:
                    at = i - bound
                    by_position = i < code.co_argcount and (written_positional is None or at < written_positional)
                    path = None if at < 0 else ("pos", at) if by_position else ("kw", name)
                    operands.append(self._operand(name, path, values[name]))
            if code.co_flags & 0x08:  # **kwargs
                extra = values.get(code.co_varnames[n_pos + bool(code.co_flags & 0x04)], {})
                for name, value in (extra or {}).items():
                    operands.append(self._operand(name, ("kw", name), value))
        else:
            is_method = torch_func_name(func).startswith("Tensor.") and bool(args)
            dtype_only = torch_func_name(func) in _READS_DTYPE_OF_OTHERS
            for i, value in enumerate(args):
                path = ("self",) if (i == 0 and is_method) else ("pos", i - int(is_method))
                if dtype_only and i > 0 and isinstance(value, torch.Tensor):
                    value = value.dtype
                operands.append(self._operand(f"arg{i}", path, value))
            for name, value in kwargs.items():
                if dtype_only and isinstance(value, torch.Tensor):
                    value = value.dtype
                operands.append(self._operand(name, ("kw", name), value))
        return operands

    def _operand(self, name, path, value) -> Operand:
        if isinstance(value, torch.Tensor):
            return Operand(name, path, tid=self._tid(value))
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return Operand(name, path, value=TensorList(self._tid(v) for v in value))
        return Operand(name, path, value=_plain(value))

    # ---- driver -------------------------------------------------------------------------
    def run(self, mode: str, batch_slices: int = 1) -> Trace:
        """`batch_slices` > 1: trace on the first 1/batch_slices of the example batch, as one data-
        parallel rank or micro-batch runs it (graph/batch_probe.py compares the two traces)."""
        entry = self.entry
        ctx = quiet_fake_mode() if mode == "fake" else contextlib.nullcontext()
        with ctx:
            torch.manual_seed(0)
            with _CtorRecorder() as ctors:
                model = self._call_user(entry.build, "build()")
            self._add_model_files(model)
            self._leaf_ids = {id(m) for m in model.modules() if type(m) in self.leaf_types
                              or type(m).__qualname__ not in self._traced_classes.get(type(m).__module__, (
                                  type(m).__qualname__,))}
            ctor_sites = {key: self._ctor_site(stack) for key, stack in ctors.stacks.items()}
            ctor_callers = {key: self._ctor_caller(stack) for key, stack in ctors.stacks.items()}
            inputs = self._call_user(entry.example_inputs, "example_inputs()")
            if batch_slices > 1:
                inputs = _batch_slice(inputs, batch_slices)
            params = self._params(model, ctor_sites, ctor_callers)
            for name, buf in model.named_buffers():
                self._tid(buf, buffer=name)
            input_tids = self._inputs(inputs)
            for tensor in [*model.parameters(), *model.buffers(), *tree_flatten(inputs)[0]]:
                if isinstance(tensor, torch.Tensor) and _storage(tensor) is not None:
                    self._storage_maker[_storage(tensor)] = None     # kept anyway: no activation
            model.train()
            self._recording = True
            hook = torch.nn.modules.module.register_module_forward_pre_hook(self._module_called)
            after = torch.nn.modules.module.register_module_forward_hook(self._module_returned)
            profiler = sys.getprofile()
            if mode == "fake" and self.replicate:
                self.replicator = Replicator(self, model)
            try:
                # the model and its parameters live on through the forward
                with objects_so_far_kept(), self, _StateWriteRecorder(self), _CopiedBlocks(self.replicator), \
                        torch.autograd.graph.saved_tensors_hooks(self._saving, lambda tensor: tensor):
                    sys.setprofile(self._profile)
                    output = self._call_user(lambda: entry.call_model(model, inputs), "the model's forward")
                    loss = self._call_user(lambda: entry.loss(output), "loss()")
            finally:
                sys.setprofile(profiler)
                self._recording = False
                hook.remove()
                after.remove()
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise UserError("loss() did not return a scalar tensor", Location(display_path(entry.path)),
                                hint="return the training loss as a 0-dim tensor")
            loss_tid = self._tid_of.get(id(loss))
            if mode == "real":
                self._call_user(loss.backward, "backward()")
            elif not loss.requires_grad:    # where backward() would stop first
                raise UserError("backward() raised RuntimeError: element 0 of tensors does not require grad and "
                                "does not have a grad_fn", Location(display_path(entry.path)),
                                hint="the model must run on its example inputs on one CPU device")
        with objects_so_far_kept():       # the forward's records live on
            self._set_outputs(loss_tid)
            if not self.leaf_types:
                self.role_layers = self._role_layers(model)
        batch = next((self.tensors[t].shape[0] for t in input_tids.values() if self.tensors[t].shape), None)
        return Trace(mode, sorted(self.own_files), self.nodes, self.ops, self.tensors, params, input_tids,
                     loss_tid, {name: qualified_type(type(m)) for name, m in model.named_modules()}, batch,
                     self.size_queries, self.module_calls, self.containers, self.replays, self.state_writes,
                     self.module_runs, self.module_replays, self._module_aliases(model), self.mixed_containers,
                     self._saved_by_node(), {*self._saved_storages, *(
                         storage for storage, maker in self._storage_maker.items() if maker is None)},
                     [name for name, m in model.named_modules() if m._state_dict_hooks],
                     self.unsliceable_containers, self.line_layers)

    def _saving(self, tensor: torch.Tensor) -> torch.Tensor:
        """autograd's pack hook: it fires, inside the op being run, for each tensor that op keeps
        for its backward (a matmul its inputs, a softmax its output, a masked_fill its mask)."""
        storage = _storage(tensor)
        if storage is not None and self._log is not None:
            self._log.append(("saved", storage, tensor.untyped_storage().nbytes(), len(self.ops)))
        if storage is not None and storage not in self._saved_storages:
            self._saved_storages[storage] = (tensor.untyped_storage().nbytes(), len(self.ops))
            self._keep.append(tensor)       # its storage address stays its own while the trace runs
        return tensor

    def _saved_by_node(self) -> dict[int, int]:
        """Bytes autograd keeps from forward to backward, by node: each storage once (a view
        saved shares its base's), counted at the node whose op made it; one made inside an op and
        never returned (a fused kernel's temporary) at the node of the op that saved it.
        Parameters, buffers and the inputs are held anyway and are not counted."""
        saved: dict[int, int] = {}
        for storage, (nbytes, ops_before) in self._saved_storages.items():
            if storage in self._storage_maker:
                node = self._storage_maker[storage]
            else:       # the op that saved it is recorded next, as op number `ops_before`
                node = self.ops[min(ops_before, len(self.ops) - 1)].node if self.ops else None
            if node is not None:
                saved[node] = saved.get(node, 0) + nbytes
        return saved

    def _module_aliases(self, model: torch.nn.Module) -> dict[str, list[str]]:
        aliases: dict[str, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            first = self._module_names.get(id(module), name)
            if first != name:
                aliases.setdefault(first, []).append(name)
        return aliases

    def _role_layers(self, model: torch.nn.Module) -> frozenset:
        """Layer classes of the model's files that are called from two or more places: a
        projection class serving as the fused qkv, the output and both MLP layers
        (`FalconLinear`, an nn.Linear whose forward is `x @ self.weight.T`), or a convolution
        class serving as each conv of a bottleneck. Traced line by line, every instance runs the
        one line of its forward, and one source line takes one split: the column and the row
        layers could not both split. Called as one op at each call site instead (`self.dense(x)`),
        each place gets its own split, derived by the probe like a library layer's.
        A layer here: its forward is in the model's files, it holds a weight of two or more
        dims itself that meets the activations (see _weights_meeting_activations: a projection
        or a convolution, not an embedding table, whose roles all split alike), and no module
        under it holds parameters (an attention block holding its projections is not one)."""
        meeting = self._weights_meeting_activations()
        places: dict[type, set] = {}
        for name, module in model.named_modules():
            cls = type(module)
            forward = getattr(getattr(cls, "forward", None), "__code__", None)
            if forward is None or forward.co_filename not in self.own_files:
                continue
            if not any(p.dim() >= 2 and (self._tid_of.get(id(p)), name) in meeting
                       for p in module.parameters(recurse=False)):
                continue
            if any(True for child in module.children() for _ in child.parameters()):
                continue
            call = self.module_calls.get(name)
            if call is not None:
                places.setdefault(cls, set()).add(call[0])
        return frozenset(cls for cls, spans in places.items() if len(spans) > 1)

    def _weights_meeting_activations(self) -> set[tuple[int, str]]:
        """(parameter, module path) where the forward of the module at that path brings the
        parameter, alone or through ops on parameters only (`self.weight.T`, a weight
        standardized by its own statistics), into an op together with a floating tensor not
        computed from parameters alone: a weight multiplied into the activations. An embedding
        table meets integer ids only in its own forward (a tied output layer's matmul is the
        head's)."""
        sources: dict[int, set[int]] = {tid: {tid} for tid, info in self.tensors.items() if info.param is not None}
        meeting: set[tuple[int, str]] = set()
        for op in self.ops:
            if not op.inputs:
                continue
            weights = [t for t in op.inputs if t in sources]
            if len(weights) == len(op.inputs):
                for out in op.outputs:
                    sources[out] = set().union(*(sources[t] for t in weights))
            elif weights and any(_floating(self.tensors[t].dtype) for t in op.inputs if t not in sources):
                path = self.nodes[op.node].module_path
                meeting.update((param, path) for t in weights for param in sources[t])
        return meeting

    def _state_written(self, module, name: str, frame) -> None:
        path = self._module_names.get(id(module))
        if path is None:
            return
        stack = []
        while frame is not None:
            if frame.f_code.co_filename in self.own_files:
                span = self._span(frame)
                if span is not None:
                    stack.append(span)
            frame = frame.f_back
        if stack:
            self.state_writes.append(StateWrite(path, name, len(self.nodes) - 1, stack))

    def _call_user(self, fn, what: str):
        try:
            return fn()
        except UserError:
            raise
        except Exception as exc:
            loc = user_frame_location(exc, self.own_files) or Location(display_path(self.entry.path))
            raise UserError(f"{what} raised {type(exc).__name__}: {exc}", loc,
                            hint="the model must run on its example inputs on one CPU device") from exc

    def _add_model_files(self, model: torch.nn.Module) -> None:
        """The model's own files: where its module classes are defined, and the module classes
        whose forward or __init__ they inherit (torchtitan's Llama3Model runs the block loop of
        its base Decoder, in another file), unless torch or a library. Mixins (transformers'
        GenerationMixin) and bases that only add helpers hold no layer code."""
        for name, module in model.named_modules():
            self._module_names[id(module)] = name
            for cls in type(module).__mro__:
                mod_name = cls.__module__
                if cls is not type(module) and not (issubclass(cls, torch.nn.Module) and (
                        "forward" in vars(cls) or "__init__" in vars(cls))):
                    continue
                if (mod_name.startswith("torch.") or mod_name.startswith(self.library_modules)) \
                        and mod_name not in self.traced_modules:
                    continue
                path = sys.modules[mod_name].__dict__.get("__file__") if mod_name in sys.modules else None
                if path and path.endswith(".py"):
                    self.own_files.add(resolved(path))
        # co_filename is the path as imported; compare both spellings
        self.own_files |= {str(Path(p)) for p in list(self.own_files)}
        for path in self.own_files:
            self.sources.get(path)
        wanted = set(self.own_files)
        # A module file resolving to an own file is that same file: one stat (its inode) rules out
        # the thousands of torch / library modules, where resolving is a system call per component.
        inodes = set(filter(None, map(_inode, wanted)))
        for mod in list(sys.modules.values()):     # resolved once per module, not once per own file
            file = getattr(mod, "__file__", None)
            if isinstance(file, str) and file not in wanted:
                inode = _inode(file)
                if (inode is None or inode in inodes) and resolved(file) in wanted:
                    self.own_files.add(file)

    def _params(self, model, ctor_sites, ctor_callers) -> dict[str, ParamInfo]:
        params: dict[str, ParamInfo] = {}
        by_id: dict[int, ParamInfo] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in by_id:
                by_id[id(param)].aliases.append(name)
                continue
            owner_path, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_path)
            span, ctor_type = ctor_sites.get(id(param), (None, None))
            info = ParamInfo(name, [name], tuple(param.shape), ctor_type or short_type(qualified_type(type(owner))),
                             attr, span, tid=self._tid(param, param=name), ctor_caller=ctor_callers.get(id(param)))
            params[name] = by_id[id(param)] = info
        return params

    def _ctor_site(self, stack) -> tuple[Span | None, str | None]:
        """The own-file call that created a parameter, and the type it constructed there.

        `nn.Linear(...)` in the model file gives torch.nn.Linear; `nn.Parameter(...)` written
        directly in the model file gives torch.nn.Parameter.
        """
        ctor_type = "torch.nn.Parameter"
        for file, pos, constructing in stack:
            if file in self.own_files:
                return self._stack_span(file, pos), ctor_type
            if constructing is not None:
                ctor_type = short_type(qualified_type(constructing))
        return None, None

    def _ctor_caller(self, stack) -> Span | None:
        """The own-file call one frame above a parameter's constructor call: where a helper that
        builds the layer (`conv3x3(inplanes, planes)`) was called."""
        own = [(file, pos) for file, pos, _ in stack if file in self.own_files]
        return self._stack_span(*own[1]) if len(own) > 1 else None

    def _stack_span(self, file, pos) -> Span | None:
        if not pos or pos[0] is None:
            return None
        source = self.sources.get(file)
        return Span(str(source.path), pos[0], source.char_col(pos[0], pos[2]), pos[1], source.char_col(pos[1], pos[3]))

    def _inputs(self, inputs) -> dict[str, int]:
        """Each tensor of the inputs by its name: `tokens`, `arg0`, or `arg0['tokens']` inside a
        dict, list or tuple handed in as one argument (`forward(self, batch)`)."""
        items = inputs.items() if isinstance(inputs, dict) else (
            (f"arg{i}", v) for i, v in enumerate(inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
        return {name: self._tid(value, input_name=name) for name, value in _named_tensors(items)}

    def _set_outputs(self, loss_tid) -> None:
        """A node's outputs: what it produced that another node (or the loss) consumes."""
        consumed: set[tuple[int, int]] = set()
        for node in self.nodes:
            for tid in node.inputs:
                consumed.add((tid, node.index))
            for op_index in node.ops:
                for tid in self.ops[op_index].inputs:
                    consumed.add((tid, node.index))
        used_elsewhere = {tid for tid, user in consumed if self.tensors[tid].producer not in (None, user)}
        for node in self.nodes:
            node.outputs = [t for t in node.produced if t in used_elsewhere or t == loss_tid]


_SCALARS = (int, float, bool, str, type(None), torch.dtype, type(Ellipsis))


def _plain(value, depth=0):
    """Keep small, printable argument values (ints, shapes, slices); drop everything else."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, slice):
        return slice(*(_plain(v, depth + 1) for v in (value.start, value.stop, value.step)))
    if isinstance(value, (tuple, list, torch.Size)) and len(value) <= 16 and depth < 3:
        items = tuple(_plain(v, depth + 1) for v in value)
        return UNKNOWN if any(v is UNKNOWN for v in items) else items
    return UNKNOWN


@contextlib.contextmanager
def quiet_fake_mode(small_constants: bool = True):
    """Fake tensors for a trace or a dry run; `small_constants=False` for a shape check of real
    operands (the probe's sliced shapes): computing a constant for real there would run the real
    kernel on the very shapes the check is for."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from .deferred_dynamo import defer
    from .fake_constants import SmallConstants     # `.item()` of a schedule made from numbers in build()
    defer()
    # FakeTensorMode logs a traceback of its own when a user op fails (shape mismatch); the
    # failure reaches the user as one UserError instead, so keep its logger quiet meanwhile.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, fake_log.disabled = fake_log.disabled, True
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, \
                (SmallConstants(fake_mode) if small_constants else contextlib.nullcontext()):
            yield
    finally:
        fake_log.disabled = was_disabled


def trace_model(entry: Entry, sources: SourceSet, *, library_modules=(), mode: str = "auto",
                batch_slices: int = 1, traced_modules=(), replicate: bool = True) -> Trace:
    """Trace under fake tensors; fall back to real CPU tensors when fake mode cannot run.
    `replicate` traces each repeated block once and copies its records (trace/replicate.py).
    When the trace finds layer classes called from several places (Tracer._role_layers), the
    model is traced again with each of their calls one op."""
    def run(how: str) -> Trace:
        tracer = Tracer(sources, entry, library_modules, traced_modules=traced_modules, replicate=replicate)
        trace = tracer.run(how, batch_slices)
        if tracer.role_layers:
            return Tracer(sources, entry, library_modules, tracer.role_layers,
                          traced_modules=traced_modules, replicate=replicate).run(how, batch_slices)
        return trace

    if mode in ("auto", "fake"):
        try:
            return run("fake")
        except UserError as fake_error:
            if mode == "fake":
                raise
            weights = _parameter_bytes_on_meta(entry)
            if weights is not None and weights > MAX_REAL_TRACE_BYTES:
                # the model's own error, not an allocation failure a real trace would end in
                fake_error.message += (f" (not retried on real tensors: its parameters would take "
                                       f"{weights / 2**30:.1f} GiB, over the {MAX_REAL_TRACE_BYTES / 2**30:g} GiB "
                                       "a trace may allocate)")
                raise fake_error from None
    return run("real")


# A fake trace that fails is retried on real CPU tensors only for a model whose parameters fit here.
MAX_REAL_TRACE_BYTES = 4 * 2**30


def _parameter_bytes_on_meta(entry: Entry) -> int | None:
    """The bytes of the model's parameters and buffers, built on the meta device (no memory);
    None when build() cannot run there."""
    try:
        with torch.device("meta"):
            model = entry.build()
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    except Exception:   # noqa: BLE001 -- a build() that needs real tensors: the count is unknown
        return None


def _floating(dtype_name: str) -> bool:
    dtype = getattr(torch, dtype_name.removeprefix("torch."), None)
    return isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of the tensor's storage: the same for every view of it."""
    try:
        return tensor.untyped_storage()._cdata
    except Exception:   # noqa: BLE001 - a tensor subclass without a storage
        return None


def _strides(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The tensor's strides when they differ from the contiguous ones of its shape, else None."""
    try:
        if tensor.layout != torch.strided or tensor.is_contiguous():
            return None
        return tuple(int(s) for s in tensor.stride())
    except Exception:   # noqa: BLE001 - a tensor subclass without strides: taken as contiguous
        return None


def _named_tensors(items):
    """(name, tensor) for each tensor under the (name, value) pairs, in dicts, lists and tuples."""
    for name, value in items:
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, dict):
            yield from _named_tensors((f"{name}[{k!r}]", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            yield from _named_tensors((f"{name}[{i}]", v) for i, v in enumerate(value))


def _batch_slice(inputs, slices: int):
    """The example inputs cut to the first 1/slices of the batch (the first input's dim 0)."""
    batch = next((v.shape[0] for _, v in _named_tensors([("", inputs)]) if v.dim()), None)
    if batch is None or batch % slices:
        raise UserError(f"the batch of {batch} does not split into {slices} slices")
    return map_tensors(lambda value: value[:batch // slices] if value.dim() and value.shape[0] == batch else value,
                       inputs)


def _model_or_torch_frame(frame, own_files) -> bool:
    path = frame.f_code.co_filename
    return path in own_files or path.startswith(_TORCH_DIR) or path.startswith(_OUR_DIR) \
        or frame.f_code.co_name in _WRAPPER_NAMES


def _wraps(frame, code) -> bool:
    """The frame is a decorator's wrapper calling the function of `code` (`functools.wraps`
    closures: transformers' `deprecate_kwarg`, torch's `no_grad`): named as wrappers are, or
    holding that function in one of its closure's variables, whatever the wrapper is named."""
    own = frame.f_code
    if own.co_name in _WRAPPER_NAMES:
        return True
    if not own.co_freevars:
        return False
    values = frame.f_locals
    return any(getattr(values.get(name), "__code__", None) is code for name in own.co_freevars)


def _holds_function(frame, code) -> bool:
    """The frame has the function of `code` (or a method bound to it) among its variables."""
    return any(getattr(v, "__code__", None) is code or getattr(getattr(v, "__func__", None), "__code__", None) is code
               for v in frame.f_locals.values())


def _binds_first_parameter(code, values: dict, call) -> bool:
    """`obj.helper(a)` calling a method or classmethod: the attribute lookup fills the first
    parameter (self, cls), so the source's first argument is the function's second."""
    if not (code.co_argcount and isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and call.func.attr.value == code.co_name and code.co_varnames[0] in values):
        return False
    method = getattr(values[code.co_varnames[0]], code.co_name, None)
    return getattr(getattr(method, "__func__", None), "__code__", None) is code


def _positional_count(call) -> int | None:
    """Arguments a call's source passes by position; None when unknown (not a call, or `*args`;
    a `**kwargs` splat passes by name: `create_causal_mask(**mask_kwargs)` passes none)."""
    if not isinstance(call, cst.Call) or any(a.star == "*" for a in call.args):
        return None
    return sum(1 for a in call.args if a.keyword is None and not a.star)

