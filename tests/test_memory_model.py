"""The activation term of the memory model (plan/memory.py) against what autograd really saves.

The single-device fixture model runs one forward under saved_tensors_hooks that sum the bytes
of every distinct storage autograd keeps (parameters and the inputs excluded). The estimate is
what the fake-tensor trace saw autograd save: the same figure, not every op output (of the
attention's four T x T tensors autograd keeps only the softmax's).
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


def test_the_activation_estimate_is_what_autograd_saves_not_every_output():
    analysis = analyze(FIXTURES / "gpt.py")
    graph, trace = analysis.graph, analysis.trace
    estimate = sum(saved_bytes(n, trace) for n in graph.nodes)
    every_output = sum(trace.tensors[t].nbytes for n in graph.nodes for t in n.outputs)
    torch.manual_seed(0)
    measured = measured_saved_bytes(analysis.entry.build(), analysis.entry.example_inputs())
    assert estimate == measured < every_output, (measured, estimate, every_output)


def test_views_and_residual_adds_count_nothing_and_a_kept_mask_counts():
    analysis = analyze(FIXTURES / "gpt.py")
    trace, nodes = analysis.trace, analysis.graph.nodes
    views = [n for n in nodes if n.callee in ("Tensor.view", "Tensor.transpose")]
    assert views and all(saved_bytes(n, trace) == 0 for n in views)
    # the scale and the masked_fill keep no T x T tensor of their own; the softmax keeps its output
    attn = [n for n in nodes if n.module_path == "transformer.h.0.attn"]
    softmax = next(n for n in attn if n.callee.endswith("softmax"))
    probs = trace.tensors[softmax.outputs[0]].nbytes
    assert saved_bytes(softmax, trace) == probs
    scale_and_mask = [n for n in attn if n.callee in ("Tensor.mul", "Tensor.masked_fill")]
    assert len(scale_and_mask) == 2 and all(saved_bytes(n, trace) == 0 for n in scale_and_mask)
    # the causal mask needs no gradient, but masked_fill keeps it for backward
    mask = next(n for n in attn if n.outputs and trace.tensors[n.outputs[0]].dtype == "torch.bool")
    assert saved_bytes(mask, trace) == trace.tensors[mask.outputs[0]].nbytes
