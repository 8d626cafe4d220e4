"""Plans solved again with layers kept whole (rewrite.py _planned_again) when one constructor
line builds many layers (torchvision's Conv2dNormActivation builds every conv of a MobileNet or a
RAFT) and each plan splits another instance of it unalike: after MAX_REPLANS plans keeping the
named instances whole, the last keeps every layer those constructor lines build whole.

The plan and its rewrite are what rewrite() does; here each attempt is answered as such a model
answers it (the next instance of the line named, until all of them are whole), so that the test
runs in a second rather than minutes of rewrites."""
from __future__ import annotations

import textwrap

import nnscaler_cst.rewrite as rewriting
from nnscaler_cst.errors import UserError

MANY_FROM_ONE_LINE = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class ConvNorm(nn.Sequential):
        def __init__(self, cin, cout):
            super().__init__(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[ConvNorm(4, 4) for _ in range(8)])

        def forward(self, x):
            return self.layers(x).pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(2, 4, 4, 4),)
''')


def test_the_last_replan_keeps_every_layer_of_the_constructor_line_whole(tmp_path, monkeypatch):
    from nnscaler_cst.analysis import analyze
    path = tmp_path / "model.py"
    path.write_text(MANY_FROM_ONE_LINE)
    analysis = analyze(path)
    convs = sorted(n for n in analysis.trace.params if n.endswith(".0.weight"))
    assert len(convs) == 8 and len({analysis.trace.params[n].ctor_span for n in convs}) == 1
    attempts = []

    class Written:
        def __init__(self):
            self.plan = type("Plan", (), {"warnings": []})()

    def answer(analysis, request, every_size_read, whole_params=(), replan=True):
        attempts.append(set(whole_params))
        split = [n for n in convs if n not in whole_params]
        if split:       # the next instance the plan splits unalike
            failure = UserError("instances of this constructor split weight differently")
            failure.misshapen_params = [split[0]]
            raise failure
        return Written()

    monkeypatch.setattr(rewriting, "rewrite", answer)
    first = UserError("instances of this constructor split weight differently")
    first.misshapen_params = [convs[0]]
    written = rewriting._planned_again(analysis, None, False, first)
    assert len(attempts) == rewriting.MAX_REPLANS + 1 and set(convs) <= attempts[-1]
    assert "stays whole on every tensor-parallel rank" in written.plan.warnings[0]
