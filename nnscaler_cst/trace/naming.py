"""Canonical names for torch callables and for what a model file called."""
from __future__ import annotations


_C_NAMESPACES = {
    "torch._C._nn": "torch.nn.functional",
    "torch._C._linalg": "torch.linalg",
    "torch._C._special": "torch.special",
    "torch._C._fft": "torch.fft",
    "torch._C._VariableFunctions": "torch",
}


def torch_func_name(func) -> str:
    """torch.matmul, Tensor.view, torch.nn.functional.gelu, Tensor.T ..."""
    name = getattr(func, "__name__", repr(func))
    qualname = getattr(func, "__qualname__", name) or name
    module = getattr(func, "__module__", None)
    if name == "__get__" and hasattr(func, "__self__"):  # tensor property such as .T or .shape
        return f"Tensor.{func.__self__.__name__}"
    if qualname.split(".")[0] in ("TensorBase", "_TensorBase", "Tensor"):
        return f"Tensor.{name}"
    if qualname.startswith("_VariableFunctionsClass"):
        return f"torch.{name}"
    if module in _C_NAMESPACES:
        return f"{_C_NAMESPACES[module]}.{name}"
    if module:
        return f"{module}.{name}"
    return name


def qualified_type(obj_type: type) -> str:
    return f"{obj_type.__module__}.{obj_type.__qualname__}"


# what a subclass may define beside its torch layer's methods and still run that layer's forward
_LAYER_PRESERVING = frozenset({"__init__", "extra_repr", "reset_parameters"})
# set on a function the tracer puts on a class for the length of one call (trace/replicate.py
# watches the attributes a block's forward reads): not the class's own method
TRACER_PROBE = "__nnscaler_tracer_probe__"


def layer_type(obj_type: type) -> type:
    """The torch.nn layer a subclass runs as, for splitting: a library's `class Conv3DSimple(
    nn.Conv3d)` that only fixes the constructor's arguments runs nn.Conv3d's forward on nn.Conv3d's
    parameters, so it splits as nn.Conv3d does. A subclass overriding any method the layer has
    (forward, `_conv_forward`, a property) is its own op; torch's own subclasses (the
    parametrized layers weight norm makes) and containers (nn.Sequential) are theirs."""
    if obj_type.__module__.split(".")[0] == "torch":
        return obj_type
    base = next((b for b in obj_type.__mro__[1:] if b.__module__.startswith("torch.nn.modules.")), None)
    if base is None or base.__module__ in ("torch.nn.modules.module", "torch.nn.modules.container"):
        return obj_type
    for cls in obj_type.__mro__[:obj_type.__mro__.index(base)]:
        for name, value in vars(cls).items():
            if name not in _LAYER_PRESERVING and hasattr(base, name) and not hasattr(value, TRACER_PROBE) and (
                    callable(value) or isinstance(value, (property, staticmethod, classmethod))):
                return obj_type
    return base


def short_type(qualified: str) -> str:
    """torch.nn.modules.linear.Linear -> torch.nn.Linear; others unchanged."""
    if qualified.startswith("torch.nn.modules."):
        return "torch.nn." + qualified.rsplit(".", 1)[1]
    return qualified


def traced_split(entries) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """`[library] traced` entries as (every module named or holding a named class, per module of
    which only some classes are traced: their names). A module's other classes stay one op each."""
    modules, classes = set(), {}
    for entry in entries:
        module, _, name = entry.rpartition(".")
        if name[:1].isupper():          # a class: module.Class
            modules.add(module)
            classes.setdefault(module, set()).add(name)
        else:
            modules.add(entry)
    whole = {e for e in entries if not e.rpartition(".")[2][:1].isupper()}
    return frozenset(modules), {m: frozenset(c) for m, c in classes.items() if m not in whole}
