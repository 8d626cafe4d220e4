"""A line that calls torch's layers in a loop, one after the other (diffusers' FeedForward:
`for module in self.net: hidden_states = module(hidden_states)` over a GEGLU, a dropout and a
linear): each call is an op of its own, and the line, which runs different layers, runs them whole.

Was: the linear's op was taken into the dropout's (one instruction, repeated), so no op read its
weight, a pipeline stage running it dropped it, and the dry run failed ("computes with
...ff.net.2.weight, which another pipeline stage holds"); split as a linear, the line's rewrite
called the linear's weight on the GEGLU.
"""
from __future__ import annotations

import textwrap

from nnscaler_cst.analysis import analyze
from nnscaler_cst.rewrite import PlanRequest, rewrite

LAYER_LOOP = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class GEGLU(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.proj = nn.Linear(d, 2 * h)

        def forward(self, x):
            a, g = self.proj(x).chunk(2, dim=-1)
            return a * torch.nn.functional.gelu(g)


    class FeedForward(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.net = nn.ModuleList([GEGLU(d, 2 * d), nn.Dropout(0.0), nn.Linear(2 * d, d)])

        def forward(self, h):
            for module in self.net:
                h = module(h)
            return h


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = FeedForward(8)

        def forward(self, x):
            return (x + self.ff(x)).pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(4, 8),)
''')


def _model(tmp_path):
    path = tmp_path / "layer_loop.py"
    path.write_text(LAYER_LOOP)
    return path


def test_each_layer_a_loop_line_calls_is_an_op_of_its_own(tmp_path):
    graph = analyze(_model(tmp_path)).graph
    line = LAYER_LOOP.splitlines().index("            h = module(h)") + 1
    called = [(n.callee, n.callee_path) for n in graph.nodes if n.span is not None and n.span.line == line]
    assert called == [("torch.nn.Dropout", "ff.net.1"), ("torch.nn.Linear", "ff.net.2")], called  # GEGLU: its lines
    linear = next(n for n in graph.nodes if n.callee_path == "ff.net.2")
    assert {graph.trace.tensors[tid].param for _, tid in graph.param_operands(linear.index)} == {
        "ff.net.2.weight", "ff.net.2.bias"}


def test_a_line_running_different_layers_in_a_loop_runs_them_whole_under_tensor_parallelism(tmp_path):
    files = rewrite(analyze(_model(tmp_path)), PlanRequest(tp=2)).files     # its dry run runs the line
    assert "            h = module(h)\n" in files["model.py"]
