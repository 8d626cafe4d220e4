"""How to call one traced invocation again: the callable, its arguments with every tensor
replaced by its tensor id, and the ids of the tensors it returned.

The tracer fills these in; the op-semantics probe (graph/derive.py) replays calls on small
real tensors to learn how they may be split. Nothing here runs a call.
"""
from __future__ import annotations

import gc
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..lifetimes import every_object_visible


@dataclass(frozen=True)
class TensorRef:
    """A tensor argument, by tensor id."""

    tid: int


@dataclass
class Replay:
    fn: Callable
    args: tuple
    kwargs: dict
    state: dict[str, int] = field(default_factory=dict)   # a module's parameters and buffers by name -> tid
    outputs: list[int] | None = None                     # tensor ids of the results, in return order

    @property
    def module(self) -> torch.nn.Module | None:
        return self.fn if isinstance(self.fn, torch.nn.Module) else None

    @property
    def recurrent(self) -> bool:
        """Does the call run one of torch's recurrent layers (nn.LSTM, nn.GRU, nn.RNN, or their
        functions)?"""
        if self.module is not None:
            return any(isinstance(m, torch.nn.RNNBase) for m in self.module.modules())
        return any(self.fn is f for f in _RECURRENT_FUNCTIONS)


_RECURRENT_FUNCTIONS = (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)


def with_refs(value: Any, tid_of: Callable[[torch.Tensor], int], depth: int = 0) -> Any:
    """`value` with tensors replaced by TensorRef, through tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return TensorRef(tid_of(value))
    if depth > 4:
        return value
    if isinstance(value, (tuple, list)):
        items = [with_refs(v, tid_of, depth + 1) for v in value]
        return type(value)(items) if type(value) in (tuple, list) else value
    if type(value) is dict:
        return {k: with_refs(v, tid_of, depth + 1) for k, v in value.items()}
    return value


def substitute(value: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The inverse of with_refs: TensorRef replaced by the tensor given for its id."""
    if isinstance(value, TensorRef):
        return tensors[value.tid]
    if type(value) in (tuple, list):
        return type(value)(substitute(v, tensors) for v in value)
    if type(value) is dict:
        return {k: substitute(v, tensors) for k, v in value.items()}
    return value


_FUNCTIONS: dict[types.CodeType, Callable | None] = {}


def function_of(code: types.CodeType, module_globals: dict | None = None) -> Callable | None:
    """The one function object running `code`, or None when there is none or several (closures
    of one code object may differ in what they captured)."""
    if code not in _FUNCTIONS:
        found = _by_qualified_name(code, module_globals) if module_globals is not None else None
        if found is None:   # a closure, or renamed: every function object on the heap (slow with a big heap)
            with every_object_visible():
                found = [f for f in gc.get_referrers(code) if isinstance(f, types.FunctionType) and f.__code__ is code]
            found = found[0] if len(found) == 1 else None
        _FUNCTIONS[code] = found
    return _FUNCTIONS[code]


def _by_qualified_name(code: types.CodeType, module_globals: dict) -> Callable | None:
    """A module-level function or a class's method, reached by its qualified name from its
    module: the one function of that code (no closure can have captured anything)."""
    if code.co_freevars or "<locals>" in code.co_qualname:
        return None
    value: Any = module_globals
    for part in code.co_qualname.split("."):
        value = value.get(part) if isinstance(value, dict) else inspect.getattr_static(value, part, None)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
    return value if isinstance(value, types.FunctionType) and value.__code__ is code else None


def arguments_at_entry(frame) -> dict[str, Any]:
    """The parameters of a Python frame as the call begins (before the body can rebind them)."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
    return {name: frame.f_locals[name] for name in code.co_varnames[:count] if name in frame.f_locals}


def call_arguments(code: types.CodeType, values: dict[str, Any]) -> tuple[tuple, dict]:
    """(args, kwargs) that call a function of `code` with these parameter values."""
    names = code.co_varnames
    n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
    args = [values[name] for name in names[:n_pos]]
    kwargs = {name: values[name] for name in names[n_pos:n_pos + n_kw]}
    extra = n_pos + n_kw
    if code.co_flags & 0x04:     # *args
        args += list(values[names[extra]])
        extra += 1
    if code.co_flags & 0x08:     # **kwargs
        kwargs.update(values[names[extra]])
    return tuple(args), kwargs
