"""Under fake tensors, a small tensor computed from Python numbers alone keeps its real values.

Model constructors read values out of tensors they make from numbers: the stochastic-depth
schedule `[x.item() for x in torch.linspace(0, rate, depth)]` (54 of timm's model files, through
timm.layers.calculate_drop_path_rates), `torch.linspace(0, rate, sum(depths)).tolist()`
(transformers' Swin and ConvNeXt), `torch.tensor(depths).cumsum(0).tolist()`. FakeTensorMode
keeps a real copy (its `constant`) only of `torch.tensor(...)` and of results of one element,
so `.item()` on such a tensor raises DataDependentOutputException, and the trace used to fall
back to real tensors: the whole model built, run and backpropagated for real, the dry run of
the output too (minutes for a CNN at its own image size).

`SmallConstants` (a TorchFunctionMode under the FakeTensorMode) makes the result of a call all
of whose tensor arguments are such constants (or that has none: a factory) a constant too,
computed for real, when it is small, on the CPU, needs no gradient, and drew no random
numbers, and is no factory of uninitialized memory (`torch.empty`: a new layer's weight and
bias, whose values nobody can know). Everything else stays fake. It never changes what a call
computes, only whether its values are known. The one call it does not run is a `torch.nn.init`
fill of a fake tensor whose values are unknown (a new layer's weight): it would compute values
nobody can read, and a model's thousands of them took a fifth of its build.

torch's private fake-tensor API (`constant`, its storage mapping, unset_fake_temporarily) is
used here only.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

# The largest constant kept real: a schedule per block, a relative-position table of a window.
MAX_CONSTANT_NUMEL = 4096

# torch.nn.init's in-place fills (kaiming_uniform_, normal_, ones_, orthogonal_, ...)
_INIT_FILLS = frozenset(f for name, f in vars(torch.nn.init).items()
                        if callable(f) and name.endswith("_") and not name.startswith("_"))

# Factories of uninitialized memory: no values to know (computing a layer's small bias for real,
# then its init fill on the values, was a third of a deep model's build)
_UNINITIALIZED = frozenset({torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty,
                            torch.Tensor.new_empty_strided})


class SmallConstants(TorchFunctionMode):
    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT_FILLS:
            filled = args[0] if args else kwargs.get("tensor")     # (torch.nn.init passes it by name)
            if isinstance(filled, FakeTensor) and filled.constant is None:
                return filled
        out = func(*args, **kwargs)
        if func in _UNINITIALIZED or getattr(func, "__name__", "").endswith("_") or not self._small(out):
            return out          # an in-place call, a large result: fake
        # (a call that is not in place leaves its operands' constants as they were)
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        known = {id(a): a.constant for a in tensors if isinstance(a, FakeTensor) and a.constant is not None}
        if len(known) < len(tensors):
            return out          # a fake operand: fake
        with unset_fake_temporarily():
            state = torch.get_rng_state()
            real_args, real_kwargs = tree_map_only(FakeTensor, lambda t: known[id(t)], (args, kwargs))
            real = func(*real_args, **real_kwargs)
            if not torch.equal(state, torch.get_rng_state()):    # random numbers: no values to know
                torch.set_rng_state(state)
                return out
        if type(real) is not torch.Tensor or real.shape != out.shape or real.dtype != out.dtype:
            return out
        out.constant = real     # as FakeTensorMode keeps torch.tensor(...)'s (its converter would import dynamo)
        self.fake_mode.fake_tensor_converter.add_constant_storage_mapping(out)
        return out

    def _small(self, out) -> bool:
        # (a view shares its operand's storage: FakeTensorMode keeps views fake, so do we)
        return (isinstance(out, FakeTensor) and out.fake_mode is self.fake_mode and out.constant is None
                and not out._is_view() and out.device.type == "cpu" and not out.requires_grad
                and out.numel() <= MAX_CONSTANT_NUMEL and out.layout == torch.strided)
