"""An expert bank run by `torch._grouped_mm` over tokens sorted by expert, with offsets (the
layout of torchtitan's GroupedExperts and gpt-oss's experts: weights (experts, out, in), the
matmuls in bfloat16, gate and linear interleaved in one projection). Tensor parallelism splits
every expert's intermediate dim, as Megatron's expert TP does: the derived rule of each
grouped matmul needs the probe's partial sums judged at bfloat16's rounding, its small-shape
probe needs rows `_grouped_mm` accepts, and `h[..., ::2]` keeps the split.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.graph import derive

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

E, D, H, V = 4, 16, 32, 64


class GroupedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, 2 * H, D) * 0.2)      # gate and linear interleaved
        self.w2 = nn.Parameter(torch.randn(E, D, H) * 0.2)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch._grouped_mm(x.bfloat16(), self.w1.transpose(-2, -1).bfloat16(), offs=offs)
        h = F.silu(h[..., ::2]) * h[..., 1::2]
        return torch._grouped_mm(h, self.w2.transpose(-2, -1).bfloat16(), offs=offs).type_as(x)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = GroupedExperts()

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(b * t, d)
        top, chosen = self.router(x).softmax(-1).topk(1, dim=-1)
        counts = torch.histc(chosen.view(-1).float(), bins=E, min=0, max=E - 1).int()
        order = chosen.view(-1).argsort(stable=True)
        out = self.experts(x[order], counts)
        y = torch.zeros_like(out).index_copy(0, order, out) * top
        return y.view(b, t, d)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(MoE() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build():
    return Net().to(torch.bfloat16)        # as torchtitan trains it: bfloat16 parameters


def example_inputs():
    return (torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0)),)


def loss(output):
    return output.float().pow(2).mean()
'''


@pytest.fixture()
def model(tmp_path):
    path = tmp_path / "grouped_experts.py"
    path.write_text(MODEL.lstrip())
    return path


def _grouped_mms(analysis):
    nodes = [n for n in analysis.trace.nodes if n.callee == "torch._grouped_mm"]
    assert len(nodes) == 4
    return [(analysis.graph.dims.get(n.index), analysis.graph.problems.get(n.index)) for n in nodes[:2]]


def _split(dims, operand):
    return {d for d, factors in enumerate(dims.inputs[operand].dims) if factors}


def _assert_megatron_labels(analysis):
    """The first grouped matmul splits its weights' output dim (each expert's intermediate dim),
    the second its contraction into partial sums; the offsets stay whole."""
    (up, problem_up), (down, problem_down) = _grouped_mms(analysis)
    assert up is not None and down is not None, (problem_up, problem_down)
    assert _split(up, "arg1") >= {2} and not _split(up, "offs")
    assert _split(down, "arg0") == {1} and _split(down, "arg1") >= {1} and down.reduced
    assert not _split(down, "offs")


def test_grouped_matmuls_in_bfloat16_split_like_megatrons_expert_mlp(model):
    _assert_megatron_labels(analyze(model))


def test_a_grouped_matmul_too_large_to_probe_is_probed_at_a_small_shape_it_accepts(model, monkeypatch):
    """At its smallest small shape a bfloat16 row of 4 elements is 8 bytes, which `_grouped_mm`
    refuses (rows of a multiple of 16 bytes): a larger small shape is tried."""
    monkeypatch.setattr(derive, "MAX_PROBE_ELEMENTS", 64)
    for dims, problem in _grouped_mms(analyze(model)):
        assert dims is not None and _split(dims, "arg1") and not _split(dims, "offs"), problem


def test_a_grouped_matmul_too_large_to_probe_keeps_the_splits_of_its_traced_shape(model, monkeypatch):
    """A small shape at which the call runs whole but not on the halves of a dim it divided (8
    bfloat16 per row, halved to 4: 8 bytes) would lose that dim's split (gpt-oss's experts kept
    only the contraction of the first matmul): the probe takes a larger small shape whose halves
    run, and finds the labels of the traced shape."""
    monkeypatch.setattr(derive, "MAX_PROBE_ELEMENTS", 64)
    _assert_megatron_labels(analyze(model))


def test_every_second_element_keeps_the_split_of_whole_steps(model):
    analysis = analyze(model)
    node = next(n for n in analysis.trace.nodes if n.callee == "Tensor.__getitem__"
                and analysis.trace.tensors[n.outputs[0]].shape[-1] == 32)
    dims = analysis.graph.dims[node.index]
    assert dims.outputs[0].dims[-1] and not (dims.fixed & {f.label for f in dims.outputs[0].dims[-1]})


@pytest.mark.slow
def test_grouped_experts_train_like_one_device_at_tp2(model, tmp_path):
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(model), "--tp", "2",
                             "-o", str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=600)
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, result.stdout + result.stderr
    params = json.loads((tmp_path / "out" / "plan.json").read_text())["params"]
    banks = {name: p["tp"] for name, p in params.items() if ".experts.w" in name}
    assert len(banks) == 4 and all(layout != "R" for layout in banks.values()), banks
