"""The activation term of the memory model (plan/memory.py) against what autograd really saves.

The single-device fixture model runs one forward under saved_tensors_hooks that sum the bytes
of every distinct storage autograd keeps (parameters and the inputs excluded). The estimate
must bound that from above (a plan that fits on paper must fit on the device), and be tighter
than counting every op output.
"""
from __future__ import annotations

import torch

from nnscaler_cst.analysis import analyze
from nnscaler_cst.plan.memory import saved_bytes

from conftest import REPO_ROOT

FIXTURES = REPO_ROOT / "fixtures"


def measured_saved_bytes(model: torch.nn.Module, inputs) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    given = {t.untyped_storage().data_ptr() for t in (inputs.values() if isinstance(inputs, dict) else inputs)}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in given:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return sum(storages.values())


def test_the_activation_estimate_bounds_what_autograd_saves_and_is_tighter_than_every_output():
    analysis = analyze(FIXTURES / "gpt.py")
    graph, trace = analysis.graph, analysis.trace
    estimate = sum(saved_bytes(n, trace) for n in graph.nodes)
    every_output = sum(trace.tensors[t].nbytes for n in graph.nodes for t in n.outputs)
    torch.manual_seed(0)
    measured = measured_saved_bytes(analysis.entry.build(), analysis.entry.example_inputs())
    assert measured <= estimate < every_output, (measured, estimate, every_output)


def test_views_and_outputs_without_gradients_are_not_counted():
    analysis = analyze(FIXTURES / "gpt.py")
    trace = analysis.trace
    views = [n for n in analysis.graph.nodes if n.callee in ("Tensor.view", "Tensor.transpose")]
    assert views and all(saved_bytes(n, trace) == 0 for n in views)
    no_grad = [n for n in analysis.graph.nodes
               if n.outputs and not any(trace.tensors[t].requires_grad for t in n.outputs)]
    assert no_grad and all(saved_bytes(n, trace) == 0 for n in no_grad)
