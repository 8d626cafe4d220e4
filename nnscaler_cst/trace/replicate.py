"""Repeated blocks traced once: the records of a block's call copied for each equal call.

A ModuleList of N identical blocks runs the same code N times on inputs of the same shapes; under
fake tensors the dispatch of each op is most of a trace. The first call of a block with a given
signature is traced and its records kept (a Template); a later call of a sibling block with the
same signature gets those records with its own tensor ids, node indices, module paths and
storages, and fake outputs of the same shapes, without running its forward.

Equal signature: the same class and module structure (types, parameter and buffer names,
shapes, dtypes, requires_grad, no hooks of their own), inputs of the same shapes, dtypes,
strides, storage sharing and requires_grad, the same plain non-tensor arguments, the same grad
mode and autocast state, called from the same own code position, and, for every attribute the
template's forward read on its modules (`self.layer_idx`, `self.sliding_window`), the same
value. A template whose call changed anything outside its own records (module attributes,
its inputs or parameters in place, random number generators), read tensors that are none of its
inputs, parameters or buffers, or returned a view or a constant, is never copied: every call of
that signature is traced. Only fake traces copy (a real trace runs backward).
It must not change what the trace records: a copied call records exactly what tracing it would.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .naming import TRACER_PROBE
from .records import Node, OpCall, Operand, TensorList
from .replay import Replay, TensorRef

_MODULE_FILE = torch.nn.modules.module.__file__
_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}     # nn.Module's own bookkeeping
_HOOKS = tuple(name for name in _INTERNALS if "hook" in name)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, type(Ellipsis), slice)
_MISSING = object()


@contextlib.contextmanager
def _unprofiled():
    """The tracer's profile hook is for the model's calls; with it on, the copy's own
    bookkeeping (a Python call per tensor id) would cost a hook call each."""
    profiler = sys.getprofile()
    sys.setprofile(None)
    try:
        yield
    finally:
        sys.setprofile(profiler)


def _replaced(record, **changes):
    """dataclasses.replace without its checks of every field: a copied block's records number in
    the hundreds, a deep model's copies in the hundreds too."""
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__, **changes)
    return new


def candidates(model: torch.nn.Module, leaf_ids: set[int]) -> set[int]:
    """id() of the modules held in a ModuleList or nn.Sequential beside another of their class."""
    found: set[int] = set()
    for parent in model.modules():
        if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = list(parent.children())
            for child in children:
                if id(child) not in leaf_ids and sum(type(c) is type(child) for c in children) > 1:
                    found.add(id(child))
    return found


@dataclasses.dataclass
class Template:
    module: torch.nn.Module
    nodes: tuple[int, int]
    ops: tuple[int, int]
    tids: tuple[int, int]
    queries: tuple[int, int]
    boundary: list[int]                   # tids of the inputs, parameters and buffers, in order
    outputs: Any                          # (spec, leaves): ("b", boundary index) | ("t", tid) | ("v", value)
    log: list
    reads: dict | None                    # (relative module name, attribute) -> value; None: all of them
    rebound: list = dataclasses.field(default_factory=list)   # (boundary index, the tid it has after the call)


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, _PLAIN):
        return a == b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a).__eq__ is object.__eq__:
        return False
    try:
        return bool(a == b) is True
    except Exception:   # noqa: BLE001 - no plain equality: not the same
        return False


def _user_attrs(module) -> dict:
    return {k: v for k, v in vars(module).items() if k not in _INTERNALS and k != "forward"}


class Replicator:
    """The tracer's side of copying repeated blocks (see the module docstring)."""

    def __init__(self, tracer, model: torch.nn.Module):
        self.tracer = tracer
        self.candidates = candidates(model, tracer._leaf_ids)
        self.templates: dict[tuple, list[Template]] = {}
        self.refused: set[tuple] = set()
        self.busy = False
        self._structures: dict[int, tuple | None] = {}
        self._fresh = 0
        self.copies = 0

    # ---- signatures ---------------------------------------------------------------------
    def _structure(self, module):
        known = self._structures.get(id(module))
        if known is None and id(module) not in self._structures:
            first: dict[int, str] = {}
            items: list = []
            for rel, sub in module.named_modules(remove_duplicate=False):
                if "forward" in vars(sub) or any(getattr(sub, h, None) for h in _HOOKS) \
                        or type(sub).__getattribute__ is not torch.nn.Module.__getattribute__:
                    items = None
                    break
                items.append((rel, type(sub), first.setdefault(id(sub), rel), id(sub) in self.tracer._leaf_ids))
            if items is not None:
                for rel, t in [*module.named_parameters(remove_duplicate=False),
                               *module.named_buffers(remove_duplicate=False)]:
                    items.append((rel, tuple(t.shape), t.dtype, t.requires_grad, first.setdefault(id(t), rel)))
            known = self._structures[id(module)] = None if items is None else tuple(items)
        return known

    def _key(self, module, args, kwargs):
        structure = self._structure(module)
        if structure is None:
            return None, None
        from torch._subclasses.fake_tensor import FakeTensor
        from .tracer import _storage
        leaves, spec = tree_flatten((args, kwargs))
        described, storages = [], {}
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if type(x) is not FakeTensor or x.constant is not None:
                    return None, None
                described.append((tuple(x.shape), x.dtype, tuple(x.stride()), x.storage_offset(), x.requires_grad,
                                  x.is_leaf, x._is_view(), x.device, storages.setdefault(_storage(x), len(storages))))
            elif isinstance(x, _PLAIN) and not isinstance(x, slice):
                described.append((type(x), x))
            elif callable(x) and not isinstance(x, torch.nn.Module):
                described.append(("callable", x))
            else:
                return None, None
        own = self.tracer.own_frame(sys._getframe(3))
        where = (own.f_code, own.f_lasti) if own is not None else None
        state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
                 torch.get_autocast_dtype("cpu"), torch.get_default_dtype())
        return (type(module), structure, str(spec), tuple(described), state, where), leaves

    def _boundary(self, module, leaves) -> list:
        return [*(x for x in leaves if isinstance(x, torch.Tensor)),
                *(t for _, t in module.named_parameters(remove_duplicate=False)),
                *(t for _, t in module.named_buffers(remove_duplicate=False))]

    # ---- the call -----------------------------------------------------------------------
    def call(self, call_impl, module, args, kwargs):
        """nn.Module's call of a candidate block: traced, traced as a template, or copied."""
        with torch._C.DisableTorchFunction(), _unprofiled():
            key, leaves = self._key(module, args, kwargs)
            template = None
            if key is not None and key not in self.refused:
                template = next((t for t in self.templates.get(key, ()) if self._fits(t, module, leaves)), None)
        if key is None or key in self.refused or (template is None and len(self.templates.get(key, ())) >= 4):
            return call_impl(module, *args, **kwargs)
        forward = module.forward
        if template is not None:
            def stand_in(*a, **k):
                with _unprofiled():
                    return self._copy(template, module, leaves)
        else:
            def stand_in(*a, **k):
                return self._record(key, module, forward, leaves, a, k)
        module.__dict__["forward"] = stand_in
        try:
            return call_impl(module, *args, **kwargs)
        finally:
            del module.__dict__["forward"]

    def _fits(self, template: Template, module, leaves) -> bool:
        if template.reads is None:
            pairs = zip(template.module.modules(), module.modules())
            if not all(_same(_user_attrs(a), _user_attrs(b)) for a, b in pairs):
                return False
        else:
            subs = dict(module.named_modules(remove_duplicate=False))
            if not all(_same(value, vars(subs[rel]).get(name, _MISSING)) for (rel, name), value in template.reads.items()):
                return False
        tid_of = self.tracer._tid_of
        boundary = self._boundary(module, leaves)
        if any(t is not None and id(b) not in tid_of for t, b in zip(template.boundary, boundary)):
            return False
        return self._paths_fit(template, module)

    def _paths_fit(self, template, module) -> bool:
        """The module records the copy makes are those tracing it would make: each first call of
        the template is a first call of the copy's module, or a call of one seen before."""
        tracer, names = self.tracer, self._names(template, module)
        replays, calls = set(tracer.module_replays), set(tracer.module_calls)
        for event in template.log:
            if event[0] == "replay":
                path = names[id(event[1])]
                if event[2] == "present" and path not in replays:
                    return False
                replays.add(path)
            elif event[0] == "call":
                path = names[id(event[1])]
                if event[2] == "present" and path not in calls:
                    return False
                if event[2] not in ("present", None):
                    calls.add(path)
        return True

    def _names(self, template, module) -> dict[int, str]:
        """id() of each of the template's modules -> the path of the copy's module in its place."""
        ours = dict(module.named_modules(remove_duplicate=False))
        names = self.tracer._module_names
        return {id(sub): names.get(id(ours[rel]), "") for rel, sub in template.module.named_modules(remove_duplicate=False)}

    def _rng(self):
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            return random.getstate(), bytes(torch.random.get_rng_state().numpy())

    def _record(self, key, module, forward, leaves, args, kwargs):
        tracer = self.tracer
        with torch._C.DisableTorchFunction():
            boundary = self._boundary(module, leaves)
            before = ([tracer._tid_of.get(id(b)) for b in boundary], [b._version for b in boundary], self._rng(),
                      len(tracer.state_writes), set(tracer._awaiting), set(tracer._awaiting_modules),
                      set(tracer._entry_args))
            last = tracer.nodes[-1] if tracer.nodes else None
            last_sizes = (len(last.ops), len(last.produced)) if last else None
        n0, o0, t0, q0 = len(tracer.nodes), len(tracer.ops), len(tracer.tensors), len(tracer.size_queries)
        reads: dict = {}
        dict_read = [False]
        ids = {id(sub): rel for rel, sub in reversed(list(module.named_modules(remove_duplicate=False)))}
        get = object.__getattribute__

        def reading(obj, name):
            rel = ids.get(id(obj))
            if rel is not None:
                if name == "__dict__":
                    if sys._getframe(1).f_code.co_filename != _MODULE_FILE:
                        dict_read[0] = True
                elif name not in _INTERNALS and (rel, name) not in reads:
                    reads[(rel, name)] = get(obj, "__dict__").get(name, _MISSING)
            return get(obj, name)
        setattr(reading, TRACER_PROBE, True)     # layer_type() sees the class as it is outside this call

        classes = {type(sub) for sub in module.modules()}
        self.busy, tracer._log = True, []
        for cls in classes:
            cls.__getattribute__ = reading
        try:
            out = forward(*args, **kwargs)
        finally:
            for cls in classes:
                del cls.__getattribute__
            self.busy, log, tracer._log = False, tracer._log, None
        with torch._C.DisableTorchFunction():
            after = ([tracer._tid_of.get(id(b)) for b in boundary], [b._version for b in boundary], self._rng(),
                     len(tracer.state_writes), set(tracer._awaiting), set(tracer._awaiting_modules),
                     set(tracer._entry_args))
            # an op handing an input back unmodified (dropout at p=0) gives it a new tensor id
            rebound = [(i, t) for i, (s, t) in enumerate(zip(before[0], after[0])) if s != t]
            same = all(t is not None and t >= t0 for _, t in rebound) and before[1:2] == after[1:2] \
                and before[3:] == after[3:] and all(
                x == y for x, y in zip(before[2], after[2]))
            template = self._template(module, out, boundary, before[0], (n0, o0, t0, q0), log,
                                      None if dict_read[0] else reads, last, last_sizes) if same else None
            if template is not None:
                template.rebound = rebound
            if template is None:
                self.refused.add(key)
            else:
                self.templates.setdefault(key, []).append(template)
        return out

    def _template(self, module, out, boundary, boundary_tids, starts, log, reads, last, last_sizes):
        tracer = self.tracer
        n0, o0, t0, q0 = starts
        n1, o1, t1 = len(tracer.nodes), len(tracer.ops), len(tracer.tensors)
        if last is not None and (len(last.ops), len(last.produced)) != last_sizes:
            return None
        if any(tracer.ops[i].node < n0 for i in range(o0, o1)):
            return None
        known = {t for t in boundary_tids if t is not None}
        if any(tracer.tensors[t].producer is None for t in range(t0, t1)):
            return None
        inside = {id(sub) for sub in module.modules()}
        paths = {tracer._module_names.get(i) for i in inside}

        def fits(tid):
            return tid is None or tid >= t0 or tid in known
        for i in range(n0, n1):
            node = tracer.nodes[i]
            if node.module_path not in paths or (node.callee_path is not None and node.callee_path not in paths):
                return None
            for op in node.operands:
                if not fits(op.tid) or (isinstance(op.value, TensorList) and not all(map(fits, op.value))):
                    return None
            replay = tracer.replays.get(i)
            if replay is not None and not self._plain_replay(replay, fits, inside):
                return None
        if not all(fits(t) for i in range(o0, o1) for t in tracer.ops[i].inputs):
            return None
        if not all(fits(q[1]) for q in tracer.size_queries[q0:]):
            return None
        for event in log:
            if event[0] == "replay" and isinstance(event[2], Replay) and not self._plain_replay(event[2], fits, inside):
                return None
        from torch._subclasses.fake_tensor import FakeTensor
        from .tracer import _storage
        leaves, spec = tree_flatten(out)
        described, seen_storages = [], set()
        by_id = {id(b): i for i, b in enumerate(boundary)}
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if id(x) in by_id:
                    described.append(("b", by_id[id(x)]))
                    continue
                tid = tracer._tid_of.get(id(x))
                info = tracer.tensors.get(tid) if tid is not None else None
                if info is None or tid < t0 or type(x) is not FakeTensor or x.constant is not None or x._is_view() \
                        or info.stride is not None or x.storage_offset() or _storage(x) in seen_storages \
                        or info.storage is None or info.storage[1] != info.nbytes:
                    return None
                seen_storages.add(_storage(x))
                described.append(("t", tid, x.is_leaf, x.device))
            elif isinstance(x, _PLAIN):
                described.append(("v", x))
            else:
                return None
        return Template(module, (n0, n1), (o0, o1), (t0, t1), (q0, len(tracer.size_queries)), boundary_tids,
                        (spec, described), log, reads)

    @staticmethod
    def _plain_replay(replay, fits, inside) -> bool:
        def ok(v, depth=0):
            if isinstance(v, TensorRef):
                return fits(v.tid)
            if isinstance(v, torch.Tensor):
                return False
            if isinstance(v, torch.nn.Module):
                return id(v) in inside
            if isinstance(v, (tuple, list)):
                return all(ok(x, depth + 1) for x in v)
            if isinstance(v, dict):
                return all(ok(x, depth + 1) for x in v.values())
            return True
        return ok(replay.fn) and ok(replay.args) and ok(replay.kwargs) and all(map(fits, replay.state.values())) \
            and all(map(fits, replay.outputs or ()))

    # ---- the copy -----------------------------------------------------------------------
    def _copy(self, template: Template, module, leaves):
        tracer = self.tracer
        with torch._C.DisableTorchFunction():
            from .tracer import _storage
            n0, n1 = template.nodes
            o0, o1 = template.ops
            t0, t1 = template.tids
            m0, p0, r0 = len(tracer.nodes), len(tracer.ops), len(tracer.tensors)
            boundary = self._boundary(module, leaves)
            tids = {t: tracer._tid_of[id(b)] for t, b in zip(template.boundary, boundary) if t is not None}
            tmods = dict(template.module.named_modules(remove_duplicate=False))
            rmods = dict(module.named_modules(remove_duplicate=False))
            modules = {id(tmods[rel]): rmods[rel] for rel in tmods}
            names = self._names(template, module)
            by_path = {tracer._module_names.get(id(sub)): names[id(sub)] for sub in tmods.values()}

            def tid(t):
                return None if t is None else (r0 + t - t0 if t >= t0 else tids[t])

            def node_of(i):
                return None if i is None else m0 + i - n0
            storages: dict[int, int] = {}
            for t, b in zip(template.boundary, boundary):
                theirs = tracer.tensors[t].storage if t is not None else None
                if theirs is not None:
                    storages[theirs[0]] = _storage(b)
            # the outputs, as fake tensors of the template's
            spec, described = template.outputs
            out_leaves = []
            for item in described:
                if item[0] == "b":
                    out_leaves.append(boundary[item[1]])
                elif item[0] == "v":
                    out_leaves.append(item[1])
                else:
                    info = tracer.tensors[item[1]]
                    x = torch.empty(info.shape, dtype=getattr(torch, info.dtype.removeprefix("torch.")), device=item[3])
                    if info.requires_grad:
                        x.requires_grad_()
                        if not item[2]:
                            x = x.clone()
                    storages[info.storage[0]] = _storage(x)
                    tracer._tid_of[id(x)] = tid(item[1])
                    tracer._keep.append(x)
                    out_leaves.append(x)

            def storage(s):
                if s not in storages:
                    self._fresh -= 1
                    storages[s] = self._fresh
                return storages[s]
            for t in range(t0, t1):
                info = tracer.tensors[t]
                tracer.tensors[tid(t)] = _replaced(
                    info, tid=tid(t), producer=node_of(info.producer),
                    storage=None if info.storage is None else (storage(info.storage[0]), info.storage[1]))
            for i in range(n0, n1):
                node = tracer.nodes[i]
                tracer.nodes.append(Node(
                    node_of(i), node.span, node.callee, node.callee_kind, by_path[node.module_path],
                    None if node.callee_path is None else by_path[node.callee_path],
                    [Operand(op.name, op.path, tid(op.tid),
                             TensorList(map(tid, op.value)) if isinstance(op.value, TensorList) else op.value)
                     for op in node.operands],
                    [p0 + k - o0 for k in node.ops], [], [tid(t) for t in node.produced], node.mapped))
                replay = tracer.replays.get(i)
                if replay is not None:
                    tracer.replays[node_of(i)] = self._moved(replay, tid, modules)
            for k in range(o0, o1):
                op = tracer.ops[k]
                tracer.ops.append(_replaced(op, node=node_of(op.node), inputs=[tid(t) for t in op.inputs],
                                                      outputs=[tid(t) for t in op.outputs],
                                                      writes=[(tid(a), b if b is None else tid(b)) for a, b in op.writes]))
            q0, q1 = template.queries
            tracer.size_queries.extend((span, tid(t), dim) for span, t, dim in tracer.size_queries[q0:q1])
            for event in template.log:
                kind = event[0]
                if kind == "run":
                    path = names[id(event[1])]
                    tracer.module_runs[path] = tracer.module_runs.get(path, 0) + 1
                elif kind == "replay":
                    path = names[id(event[1])]
                    if isinstance(event[2], Replay) and path not in tracer.module_replays:
                        tracer.module_replays[path] = self._moved(event[2], tid, modules)
                elif kind == "call":
                    path = names[id(event[1])]
                    if event[2] not in ("present", None) and path not in tracer.module_calls:
                        tracer._first_call(modules[id(event[1])], path, event[2], node_of(event[3]))
                elif kind == "made":
                    tracer._storage_maker.setdefault(storage(event[1]), node_of(event[2]))
                elif kind == "saved":
                    s = storage(event[1])
                    if s not in tracer._saved_storages:
                        tracer._saved_storages[s] = (event[2], p0 + event[3] - o0)
            for i, t in template.rebound:
                tracer._tid_of[id(boundary[i])] = tid(t)
            tracer._current = None
            self.copies += 1
            return tree_unflatten(out_leaves, spec)

    @staticmethod
    def _moved(replay: Replay, tid, modules) -> Replay:
        def move(v):
            if isinstance(v, TensorRef):
                return TensorRef(tid(v.tid))
            if isinstance(v, torch.nn.Module):
                return modules.get(id(v), v)
            if type(v) in (tuple, list):
                return type(v)(move(x) for x in v)
            if type(v) is dict:
                return {k: move(x) for k, x in v.items()}
            return v
        return Replay(move(replay.fn), move(replay.args), move(replay.kwargs),
                      {k: tid(t) for k, t in replay.state.items()},
                      None if replay.outputs is None else [tid(t) for t in replay.outputs])
