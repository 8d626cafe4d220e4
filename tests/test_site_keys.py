"""Call sites are named apart in the plan IR even when they start at the same place.

The calls of a method chain on one line (`x.reshape(...).transpose(2, 3).reshape(...)`) all
start at `x`, so path:line:col names them alike; the plan's split of the outer reshape was read
back for the inner one, which cannot take it, and `--tp 2` refused a model every op of which
can run (found by the fuzzer: benchmarks/FUZZ.md).
"""
from __future__ import annotations

import textwrap

from nnscaler_cst.analysis import analyze
from nnscaler_cst.plan.choices import site_keys
from nnscaler_cst.rewrite import PlanRequest, rewrite

CHAIN = textwrap.dedent('''\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, 8)
            self.head = nn.Linear(8, 8)

        def forward(self, inputs, targets):
            x = self.embed(inputs)
            B, T, C = x.shape
            x = x.reshape(B, T, 4, C // 4).transpose(2, 3).reshape(B, T, C)
            return F.mse_loss(self.head(x), targets)


    def build():
        return Model()


    def example_inputs():
        return (torch.randn(4, 5, 8), torch.randn(4, 5, 8))
    ''')


def test_sites_starting_at_the_same_place_get_their_own_names(tmp_path):
    (tmp_path / "chain.py").write_text(CHAIN)
    graph = analyze(tmp_path / "chain.py").graph
    keys = site_keys(graph)
    reshapes = [span for span, callee in graph.sites if callee == "Tensor.reshape"]
    assert len(reshapes) == 2 and reshapes[0].label == reshapes[1].label
    assert len({keys[s] for s in reshapes}) == 2
    assert all(keys[s].startswith(reshapes[0].label + "-") for s in reshapes)
    embed = next(span for span, callee in graph.sites if callee == "torch.nn.Linear" and span.line == 13)
    assert keys[embed] == embed.label                   # a site alone at its place keeps path:line:col


def test_tp_2_rewrites_the_chain_and_its_dry_run_passes(tmp_path):
    (tmp_path / "chain.py").write_text(CHAIN)
    result = rewrite(analyze(tmp_path / "chain.py"), PlanRequest(tp=2))    # refused before: r2_0 on the inner reshape
    reshapes = [t for t in result.plan.trans if t.callee == "Tensor.reshape" and t.axis == "tp"]
    assert len({t.site for t in reshapes}) == 2
