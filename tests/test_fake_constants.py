"""Spec: a small tensor a model computes from Python numbers keeps its values under fake tensors.

Constructors read values out of such tensors: the stochastic-depth schedule
`[x.item() for x in torch.linspace(0, rate, depth)]` (timm's calculate_drop_path_rates, in half
of its model files), `torch.tensor(depths).cumsum(0).tolist()`. The trace must stay on fake
tensors for them (it fell back to real ones: the whole model run and backpropagated for real,
its dry run too); random numbers and large tensors stay fake.
"""
from __future__ import annotations

import textwrap

import torch

from nnscaler_cst.analysis import analyze
from nnscaler_cst.trace.tracer import quiet_fake_mode

SCHEDULED = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim, drop):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = drop

    def forward(self, x):
        return x + self.fc(x) * (1.0 - self.drop)


class Model(nn.Module):
    def __init__(self, dim=16, depths=(1, 2), rate=0.1):
        super().__init__()
        rates = [x.item() for x in torch.linspace(0, rate, sum(depths), device="cpu")]
        starts = [0] + torch.tensor(depths).cumsum(0).tolist()
        self.blocks = nn.ModuleList(Block(dim, rates[i]) for i in range(starts[-1]))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 16),)
'''


def test_a_schedule_read_out_of_a_tensor_in_the_constructor_is_traced_on_fake_tensors(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(SCHEDULED))
    analysis = analyze(tmp_path / "model.py")
    assert analysis.trace.mode == "fake"
    assert len([n for n in analysis.trace.params if n.endswith("fc.weight")]) == 3


def test_random_and_large_tensors_stay_fake():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with quiet_fake_mode():
        assert torch.arange(6).sum(0, keepdim=True).tolist() == [15]
        assert torch.randn(3).constant is None
        assert torch.zeros(1000, 1000).constant is None
        x = torch.randn(4, 8)
        assert (x + torch.arange(8)).constant is None          # a fake operand: fake
    assert torch.equal(before, torch.get_rng_state())


def test_an_init_fill_of_an_unknown_fake_weight_is_skipped_and_a_known_constant_is_not(monkeypatch):
    # a layer's init computes values no fake trace can read; thousands of them were a fifth of a
    # deep model's build
    filled = []
    uniform = torch.Tensor.uniform_
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: filled.append(self) or uniform(self, *a, **k))
    with quiet_fake_mode():
        layer = torch.nn.Linear(8, 8)
        assert filled == [] and layer.weight.shape == (8, 8) and layer.weight.requires_grad
        known = torch.arange(4.0)
        torch.nn.init.uniform_(known)                     # a constant's values would change: run
        assert len(filled) == 1 and known.constant is None


def test_uninitialized_memory_is_no_constant():
    # torch.empty's values are whatever memory held: a layer's weight and bias are made so, and
    # keeping them as constants computed them for real, then ran their init fills on the values
    # (a deep model's parameters: a third of its build)
    with quiet_fake_mode():
        assert torch.empty(4).constant is None
        assert torch.zeros(4).constant is not None        # a fill: known
        layer = torch.nn.Linear(8, 8)
        assert layer.bias.constant is None and layer.bias.shape == (8,)
